"""Benchmark: speculative against autoregressive decoding over a prompt set.

The JSON contract (``dflash2-mlx bench --json``)::

    {"mean": {"acceptance_length", "spec_decode_tps", "ar_decode_tps", "speedup", "controller"},
     "prompts": [{"acceptance_length", "spec_decode_tps", "ar_decode_tps", "speedup", "identical", "controller"}, ...]}

- ``controller``: what the block-size policy did (tokens and their share by mode: speculative,
  plain, probe; cycles per block size; the last switch), summed over prompts in ``mean``.

- ``prompts`` are in file order; ``identical`` is true/false at temperature 0 (speculative tokens
  == autoregressive tokens) and null when sampling.
- ``mean.acceptance_length`` = all cycle tokens / all verify cycles (not a mean of ratios);
  ``mean.spec_decode_tps`` and ``mean.ar_decode_tps`` are means over prompts;
  ``mean.speedup`` = mean.spec_decode_tps / mean.ar_decode_tps.
- One warm-up run (both modes, on the first prompt, not recorded) before timing; for every prompt
  the speculative and the plain run follow each other (the order alternates between prompts, so
  neither mode always runs on a freshly cooled or freshly warmed machine).

Prompt files are JSON lines: ``{"prompt": "..."}`` (fed as is, no chat template) or
``{"messages": [...]}`` (the model's chat template applied, with the generation prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from dflash2_mlx.backend.files import JsonlError, read_jsonl

# Written for this project: short instructions whose answers mix prose, code, lists and arithmetic,
# the kinds of text acceptance differs on. Chat-template lines, for instruction-tuned targets.
BUILTIN_PROMPTS: list[dict] = [
    {
        "messages": [
            {
                "role": "user",
                "content": (
                    "Write a Python function that returns the n-th Fibonacci number iteratively, with a "
                    "docstring and two doctests."
                ),
            }
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": "Explain in three short paragraphs why the sky is blue, for a curious twelve-year-old.",
            }
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": "A train leaves at 09:40 and arrives at 13:05. How long is the trip? Show the steps.",
            }
        ]
    },
    {"messages": [{"role": "user", "content": "List ten everyday uses of a paperclip, one per line, numbered."}]},
    {
        "messages": [
            {
                "role": "user",
                "content": (
                    "Translate into French: 'The library opens at nine, but the reading room stays closed "
                    "until noon on Mondays.'"
                ),
            }
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": (
                    "Write a SQL query that returns the five customers with the highest total order value in "
                    "2024 from tables customers(id, name) and orders(id, customer_id, total, created_at)."
                ),
            }
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Summarise the rules of tic-tac-toe in at most five bullet points."},
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": "Write a short story of about 150 words about a lighthouse keeper who finds a message in a "
                "bottle.",
            }
        ]
    },
]


class PromptFileError(ValueError):
    """A prompt file that cannot be read, with the line at fault."""


def read_prompts(path: str | Path) -> list[dict]:
    """Lines of a prompts JSONL file, validated (blank lines are skipped)."""
    try:
        records = read_jsonl(path, "prompt file")
    except JsonlError as e:
        raise PromptFileError(str(e)) from None
    lines = [validate_line(item, f"{path}:{number}") for number, item in records]
    if not lines:
        raise PromptFileError(f"prompt file {path} has no prompts")
    return lines


def validate_line(item, where: str) -> dict:
    if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
        raise PromptFileError(f'{where}: each line must be an object with either "prompt" or "messages"')
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise PromptFileError(f'{where}: "prompt" must be a non-empty string')
    else:
        msgs = item["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise PromptFileError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    return item


def label(line: dict, width: int = 60) -> str:
    """A one-line preview of a prompt line (its text, or the last message's)."""
    text = line["prompt"] if "prompt" in line else line["messages"][-1]["content"]
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


@dataclass
class Run:
    tokens: list[int]
    stats: object  # GenerationStats


def _run(events) -> Run:
    from dflash2_mlx.decoding.output import collect

    return Run(*collect(events))


def _safe_ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def run_bench(
    target,
    drafter,
    lines: Sequence[dict],
    settings,
    encode: Callable[[dict], list[int]],
    on_prompt: Optional[Callable[[int, dict], None]] = None,
    warmup: bool = True,
) -> "BenchResult":
    """Run every prompt speculatively and autoregressively; ``.contract`` is the JSON object.

    ``settings`` is an engine ``GenerationSettings`` (max tokens, sampling, seed, block size, stop
    tokens); ``encode`` turns a prompt line into token ids; ``on_prompt(i, result)`` is called as
    each prompt finishes (for progress display).
    """
    from dflash2_mlx.caches.token_index import TokenIndex
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.speculative import generate_speculative

    tokenizer = target.tokenizer
    greedy = settings.sampling.greedy
    prompts = [encode(line) for line in lines]
    # the prompts share one index of earlier answers, as one client's requests do on a server
    # (an agent's session: later turns copy earlier answers); the warm-up adds nothing to it
    session = replace(settings, copy_index=TokenIndex(source="shared")) if settings.copy_drafting else settings

    def spec(ids):
        return _run(generate_speculative(target.runner, drafter, ids, session, tokenizer))

    def plain(ids):
        return _run(generate_autoregressive(target.runner, ids, settings, tokenizer))

    if warmup and prompts:
        short = replace(settings, max_tokens=min(settings.max_tokens, 32))
        _run(generate_speculative(target.runner, drafter, prompts[0], short, tokenizer))
        _run(generate_autoregressive(target.runner, prompts[0], short, tokenizer))

    results, details = [], []
    cycle_tokens = verify_steps = 0
    accepted_pos: list[int] = []
    drafted_pos: list[int] = []
    by_source: dict = {}
    for i, (line, ids) in enumerate(zip(lines, prompts)):
        if i % 2 == 0:
            s, a = spec(ids), plain(ids)
        else:
            a, s = plain(ids), spec(ids)
        st, at = s.stats, a.stats
        cycle_tokens += st.cycle_tokens
        verify_steps += st.verify_steps
        _add(accepted_pos, st.accepted_by_position)
        _add(drafted_pos, st.drafted_by_position)
        for source, counts in st.by_source.items():
            total = by_source.setdefault(source, dict.fromkeys(counts, 0))
            for what, n in counts.items():
                total[what] += n
        result = {
            "acceptance_length": st.acceptance_length,
            "spec_decode_tps": st.decode_tps,
            "ar_decode_tps": at.decode_tps,
            "speedup": _safe_ratio(st.decode_tps, at.decode_tps),
            "identical": (s.tokens == a.tokens) if greedy else None,
        }
        result["by_source"] = st.by_source
        result["controller"] = st.controller
        detail = {
            "prompt": label(line),
            "prompt_tokens": st.prompt_tokens,
            "generation_tokens": st.generation_tokens,
            "ar_generation_tokens": at.generation_tokens,
            "verify_steps": st.verify_steps,
            "acceptance_by_position": st.acceptance_by_position,
            "first_difference": None,
        }
        if greedy and not result["identical"]:
            detail["first_difference"] = next(
                (k for k, (x, y) in enumerate(zip(s.tokens, a.tokens)) if x != y), min(len(s.tokens), len(a.tokens))
            )
        results.append(result)
        details.append(detail)
        if on_prompt is not None:
            on_prompt(i, {**result, **detail})
    n = len(results)
    spec_tps = sum(r["spec_decode_tps"] for r in results) / n if n else 0.0
    ar_tps = sum(r["ar_decode_tps"] for r in results) / n if n else 0.0
    mean = {
        "acceptance_length": cycle_tokens / verify_steps if verify_steps else 1.0,
        "spec_decode_tps": spec_tps,
        "ar_decode_tps": ar_tps,
        "speedup": _safe_ratio(spec_tps, ar_tps),
        "by_source": by_source,
        "controller": merge_controller([r["controller"] for r in results]),
    }
    return BenchResult(
        {"mean": mean, "prompts": results},
        details,
        [x / d if d else 0.0 for x, d in zip(accepted_pos, drafted_pos)],
        verify_steps,
    )


def profile_cycles(target, drafter, lines: Sequence[dict], settings, encode: Callable[[dict], list[int]]) -> dict:
    """Decode every prompt speculatively once more with a ``CycleProfiler``: per-phase time shares."""
    from dflash2_mlx.decoding.profiling import CycleProfiler
    from dflash2_mlx.decoding.speculative import generate_speculative

    profiler = CycleProfiler()
    profiled = replace(settings, profiler=profiler)
    for line in lines:
        _run(generate_speculative(target.runner, drafter, encode(line), profiled, target.tokenizer))
    return profiler.as_dict()


def merge_controller(summaries: Sequence[Optional[dict]]) -> Optional[dict]:
    """The block-size policy's statistics over several runs: tokens by mode and block sizes summed,
    the last run's last switch."""
    summaries = [c for c in summaries if c]
    if not summaries:
        return None
    tokens: dict = {}
    sizes: dict = {}
    copies: dict = {}
    for c in summaries:
        for mode, n in c["tokens_by_mode"].items():
            tokens[mode] = tokens.get(mode, 0) + n
        for b, n in c["block_sizes"].items():
            sizes[b] = sizes.get(b, 0) + n
        for b, n in c.get("copy_sizes", {}).items():
            copies[b] = copies.get(b, 0) + n
    total = sum(tokens.values())
    return {
        "policy": summaries[-1]["policy"],
        "tokens_by_mode": tokens,
        "share_by_mode": {m: (n / total if total else 0.0) for m, n in tokens.items()},
        "block_sizes": dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))),
        "copy_sizes": dict(sorted(copies.items(), key=lambda kv: int(kv[0]))),
        "last_switch": next((c["last_switch"] for c in reversed(summaries) if c.get("last_switch")), None),
    }


@dataclass
class BenchResult:
    contract: dict  # exactly {"mean": {...}, "prompts": [...]} (what --json prints)
    details: list[dict]  # per prompt: its preview, token counts, acceptance by position
    acceptance_by_position: list[float]  # over all prompts
    verify_steps: int


def _add(total: list[int], more: Sequence[int]) -> None:
    for i, v in enumerate(more):
        if i < len(total):
            total[i] += v
        else:
            total.append(v)


def plot(result: "BenchResult", path: str | Path, title: str = "") -> None:
    """Throughput per prompt (speculative vs autoregressive) and acceptance by draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = result.contract["prompts"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    xs = range(len(prompts))
    width = 0.4
    ax1.bar([x - width / 2 for x in xs], [p["spec_decode_tps"] for p in prompts], width, label="DFlash 2")
    ax1.bar([x + width / 2 for x in xs], [p["ar_decode_tps"] for p in prompts], width, label="autoregressive")
    ax1.set_xticks(list(xs), [str(i + 1) for i in xs])
    ax1.set_xlabel("prompt")
    ax1.set_ylabel("decode tok/s")
    mean = result.contract["mean"]
    speed = f"{mean['speedup']:.2f}x" if mean["speedup"] else "n/a"
    ax1.set_title(f"speedup {speed}, acceptance length {mean['acceptance_length']:.2f}")
    ax1.legend()
    by_pos = result.acceptance_by_position
    ax2.bar(range(1, len(by_pos) + 1), [100 * v for v in by_pos], color="tab:green")
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("accepted %")
    ax2.set_ylim(0, 100)
    ax2.set_title("acceptance by position")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
