"""The prompt set of the SmolLM2 drafter build (stage "prompts"): made offline, deduplicated, split.

Five kinds of user requests, made from material every Python install has and fixed templates:

- ``code``: coding requests from the standard library's functions (``corpus.function_examples``:
  plain-English requests made from docstrings, and "complete this function" with a signature);
- ``explain``: explanations and prose from the language reference's topics
  (``pydoc_data/topics.py``) and the standard library's module names;
- ``short``: short-answer questions from fixed templates (arithmetic, units, capitals, words,
  built-in functions);
- ``self``: questions the target writes itself ("Write a question about X", greedy, chat template);
- ``task``: everyday chat requests from templates (write an email, give advice, make a list, plan
  a trip, explain an idea simply, write a short poem or note): what people ask a chat model that
  is not about Python (issue 40).

Requests are deduplicated (case and whitespace folded). Each kind is ordered by the sha256 of its
text; the first ``heldout_per_kind`` are held out for evaluation and the next ``train_per_kind``
train the drafter, so the split never depends on another kind or on the counts of the other split.
Every prompt is rendered with the target's own chat template (SmolLM2: ChatML with its default
system message) and an open assistant turn.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dflash2_mlx.training import corpus as corpus_mod
from dflash2_mlx.training.smollm2.generation import answer_prompts
from dflash2_mlx.training.smollm2.plan import SmolPlan, atomic_write_text

__all__ = ["KINDS", "build_prompt_set", "read_prompt_set", "request_candidates", "self_written_questions"]

KINDS = ("code", "explain", "short", "self", "task")
# Part of the stage's key: raise it when the recipe changes what the same inputs produce (3: the
# target's questions written for each request alone, no longer in left-padded batches; 4: the
# ``task`` kind)
RECIPE_VERSION = 4

CAPITALS = (
    "France",
    "Germany",
    "Italy",
    "Spain",
    "Portugal",
    "Japan",
    "China",
    "India",
    "Brazil",
    "Canada",
    "Mexico",
    "Egypt",
    "Kenya",
    "Australia",
    "Norway",
    "Sweden",
    "Poland",
    "Greece",
    "Turkey",
    "Argentina",
    "Chile",
    "Peru",
    "Ireland",
    "Austria",
    "Hungary",
    "Vietnam",
    "Thailand",
    "Nigeria",
    "Morocco",
    "Finland",
)
WORDS = (
    "happy",
    "fast",
    "ancient",
    "bright",
    "fragile",
    "generous",
    "quiet",
    "brave",
    "narrow",
    "honest",
    "curious",
    "heavy",
    "gentle",
    "rare",
    "simple",
    "strong",
    "empty",
    "careful",
    "famous",
    "polite",
)
UNITS = (
    ("centimetres", "a metre", "100"),
    ("grams", "a kilogram", "1000"),
    ("minutes", "a day", "1440"),
    ("seconds", "an hour", "3600"),
    ("millilitres", "a litre", "1000"),
    ("days", "a leap year", "366"),
    ("metres", "a kilometre", "1000"),
    ("bits", "a byte", "8"),
    ("hours", "a week", "168"),
    ("months", "a decade", "120"),
)
QUESTION_TOPICS = (
    "the solar system",
    "photosynthesis",
    "the French Revolution",
    "prime numbers",
    "the water cycle",
    "Python lists",
    "recursion",
    "climate change",
    "the human heart",
    "volcanoes",
    "the Roman Empire",
    "machine learning",
    "healthy eating",
    "the moon",
    "electricity",
    "world geography",
    "music theory",
    "chess",
    "gravity",
    "the internet",
    "ancient Egypt",
    "sorting algorithms",
    "databases",
    "bees",
    "the ocean",
    "renewable energy",
    "the printing press",
    "fractions",
    "poetry",
    "the immune system",
    "dinosaurs",
    "computer networks",
    "cooking pasta",
    "time zones",
    "the stock market",
    "rainbows",
    "Shakespeare",
    "the periodic table",
    "linear algebra",
    "birds",
    "earthquakes",
    "the Olympic Games",
    "version control with git",
    "regular expressions",
    "sleep",
    "the Great Wall of China",
    "bicycles",
    "probability",
    "the Renaissance",
    "coffee",
    "black holes",
    "writing a resume",
    "email etiquette",
    "the alphabet",
    "forests",
    "HTTP",
    "the Industrial Revolution",
    "vaccines",
    "recycling",
    "maps",
)
EMAIL_RECIPIENTS = ("my manager", "a colleague", "my landlord", "my child's teacher", "an old friend", "a customer")
EMAIL_PURPOSES = (
    "asking for a day off next Friday",
    "moving our meeting to Thursday afternoon",
    "about the heating in my flat not working",
    "thanking them for their help last week",
    "saying that I will be ten minutes late",
    "asking for feedback on a report I sent",
    "inviting them to a small birthday dinner",
    "apologising for missing their call",
)
ADVICE_TOPICS = (
    "starting to run",
    "saving money each month",
    "learning a new language",
    "preparing for a job interview",
    "sleeping better",
    "studying for exams",
    "moving to a new city",
    "speaking in public",
    "keeping houseplants alive",
    "working from home",
    "making friends as an adult",
    "cooking on a budget",
)
ADVICE_STYLES = ("Give me some advice on {}.", "What are your best tips for {}?")
LIST_SUBJECTS = (
    "ten things to pack for a beach holiday",
    "healthy breakfast ideas",
    "books a teenager might enjoy",
    "indoor activities for a rainy day",
    "questions to ask at the end of a job interview",
    "ways to use less plastic at home",
    "easy dinners that take under 30 minutes",
    "things to check before buying a used car",
    "gift ideas for someone who loves gardening",
    "ways to stay focused while studying",
    "good habits to start the morning",
    "board games for a family evening",
)
TRIP_PLACES = (
    "Paris",
    "Tokyo",
    "Rome",
    "New York",
    "Lisbon",
    "Kyoto",
    "Barcelona",
    "Iceland",
    "the Scottish Highlands",
    "Vienna",
    "Istanbul",
    "Mexico City",
)
TRIP_DAYS = (2, 3, 5)
IDEAS = (
    "inflation",
    "compound interest",
    "how vaccines work",
    "why the sky is blue",
    "the greenhouse effect",
    "supply and demand",
    "how a car engine works",
    "what a mortgage is",
    "how plants grow",
    "what a credit score is",
    "how airplanes fly",
    "why we have seasons",
    "what the immune system does",
    "how the internet reaches my home",
)
IDEA_AUDIENCES = ("a ten-year-old", "a complete beginner", "someone in a hurry")
POEM_SUBJECTS = ("autumn leaves", "a cup of tea", "the sea at night", "a lost umbrella", "Monday mornings", "my cat")
NOTES = (
    "Write a short thank-you note to a neighbour who watered my plants.",
    "Write a birthday message for my sister.",
    "Write a polite message declining a party invitation.",
    "Write a short toast for a friend's wedding.",
    "Write a two-sentence product description for a reusable water bottle.",
    "Write a short note to leave for a house sitter.",
)
QUESTION_STYLES = (
    "Write a question about {}.",
    "Write a short question a student might ask about {}.",
    "Ask one question about {} that has a clear answer.",
)


def question_in(text: str) -> Optional[str]:
    """The question in what the target wrote, or None: a small model often wraps it ('A student
    might ask: "...?"') or answers instead of asking. A quoted question wins; else the sentence
    that ends at the first question mark."""
    quoted = re.search(r'"([^"]{10,300}\?)"', text)
    if quoted:
        return quoted.group(1).strip()
    end = text.find("?")
    if end < 0:
        return None
    starts = [text.rfind(sep, 0, end) + len(sep) for sep in (". ", "! ", ": ", "\n") if sep in text[:end]]
    question = text[max(starts, default=0) : end + 1].strip().strip('"')
    return question if 10 <= len(question) <= 300 else None


def fold(text: str) -> str:
    """The deduplication key of a request: lower case, whitespace runs as one space."""
    return re.sub(r"\s+", " ", text.strip().lower())


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def request_candidates(plan: SmolPlan) -> dict[str, list[str]]:
    """Every candidate request of the offline kinds (code, explain, short), deduplicated, in a
    fixed order (the sha256 of the text)."""
    files = corpus_mod.load_corpus(limit=plan.corpus_limit)
    train_files, _ = corpus_mod.split(corpus_mod.deduplicate(files))
    code = []
    for f in train_files:
        for user, _answer in corpus_mod.function_examples(f, 40, 30, requests=True):
            if user.startswith("Write a"):
                code.append(user.strip())
            else:
                code.append("Complete this Python function:\n```python\n" + user.rstrip() + "\n```")
    from pydoc_data.topics import topics

    explain = []
    for name, text in sorted(topics.items()):
        title = text.strip().splitlines()[0].strip()
        explain.append(f"Explain {title} in Python, with a short example.")
        paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200 and "::=" not in p]
        if paragraphs:
            explain.append(
                "Summarise this passage from the Python documentation in two sentences:\n\n" + paragraphs[0][:700]
            )
    modules = sorted({corpus_mod.module_name(f.relative).split(".")[0] for f in train_files})
    explain += [f"What is the Python module `{m}` used for?" for m in modules if not m.startswith("_")]

    rng = np.random.default_rng(plan.seed)
    short = [f"What is the capital of {c}?" for c in CAPITALS]
    short += [f"Give one synonym and one antonym of the word '{w}'." for w in WORDS]
    short += [f"How many {small} are there in {big}?" for small, big, _ in UNITS]
    import builtins

    short += [
        f"What does the Python built-in function `{b}` do? Answer in one sentence."
        for b in sorted(
            n for n in dir(builtins) if n.islower() and not n.startswith("_") and callable(getattr(builtins, n))
        )
    ]
    for a, b in rng.integers(2, 99, size=(60, 2)):
        short.append(f"What is {a} + {b}?" if (a + b) % 2 else f"What is {a} times {b}?")
    return {"code": _unique(code), "explain": _unique(explain), "short": _unique(short), "task": task_requests()}


def task_requests() -> list[str]:
    """The ``task`` kind: everyday chat requests from templates, deduplicated, in sha256 order."""
    task = [f"Write a short email to {who} {why}." for who in EMAIL_RECIPIENTS for why in EMAIL_PURPOSES]
    task += [style.format(t) for style in ADVICE_STYLES for t in ADVICE_TOPICS]
    task += [f"Make a list of {s}." for s in LIST_SUBJECTS]
    task += [f"Plan a {days}-day trip to {place} for me." for place in TRIP_PLACES for days in TRIP_DAYS]
    task += [f"Explain {idea} to me as if I were {who}." for idea in IDEAS for who in IDEA_AUDIENCES]
    task += [f"Write a short poem about {s}." for s in POEM_SUBJECTS]
    return _unique(task + list(NOTES))


def _unique(requests: list[str]) -> list[str]:
    seen, out = set(), []
    for r in sorted(requests, key=_digest):
        if fold(r) not in seen:
            seen.add(fold(r))
            out.append(r)
    return out


def self_written_questions(
    target, count: int, max_tokens: int, batch_size: int, log: Callable[[str], None] = print
) -> list[str]:
    """Questions the target writes itself: "Write a question about X" for ``count`` (topic, style)
    pairs, greedy, each cut at the end of the turn (or at ``max_tokens``); answers holding no
    question are dropped (``question_in``)."""
    tok = target.tokenizer
    asks = [style.format(topic) for style in QUESTION_STYLES for topic in QUESTION_TOPICS][:count]
    ids = [
        tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True)
        for a in asks
    ]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    stops = sorted(tok.eos_token_ids)
    out: dict[int, str] = {}
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        # each request answered as alone (no padding), cut after its end token
        for i, answer in zip(rows, answer_prompts(target.runner, [ids[i] for i in rows], max_tokens, stop_ids=stops)):
            out[i] = question_in(tok.decode([int(t) for t in answer if int(t) not in stops]))
        log(f"prompts: the target wrote {len(out)}/{len(asks)} answers")
    return [out[i] for i in range(len(asks)) if out[i] is not None]


def build_prompt_set(plan: SmolPlan, target, out: Path, log: Callable[[str], None] = print) -> dict:
    """Write the prompt set (JSONL, one object a line: id, kind, split, messages, prompt) to ``out``
    and return its counts."""
    candidates = request_candidates(plan)
    wanted_self = plan.train_per_kind["self"] + plan.heldout_per_kind["self"]
    # a few more than needed: some answers are not questions, some repeat
    written = self_written_questions(
        target,
        min(len(QUESTION_TOPICS) * len(QUESTION_STYLES), max(2 * wanted_self, 1)),
        plan.question_tokens,
        plan.batch_size,
        log,
    )
    taken = {fold(r) for kind in candidates.values() for r in kind}
    candidates["self"] = [q for q in _unique(written) if fold(q) not in taken]
    rows, counts = [], {}
    for kind in KINDS:
        pool = candidates[kind]
        held, train = plan.heldout_per_kind[kind], plan.train_per_kind[kind]
        if len(pool) < held:
            raise ValueError(f"only {len(pool)} {kind} prompts for {held} held-out ones")
        for split, chosen in (("heldout", pool[:held]), ("train", pool[held : held + train])):
            counts[f"{kind}_{split}"] = len(chosen)
            for text in chosen:
                messages = [{"role": "user", "content": text}]
                prompt = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                rows.append(
                    {
                        "id": f"{kind}-{_digest(text)[:12]}",
                        "kind": kind,
                        "split": split,
                        "messages": messages,
                        "prompt": prompt,
                    }
                )
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    log(f"prompts: {counts} -> {out}")
    return counts


def read_prompt_set(path: Path, split: Optional[str] = None) -> list[dict]:
    """The prompt set's rows in file order (only ``split``'s when given)."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if split is None or r["split"] == split]
