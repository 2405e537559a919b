"""Rebuild the embedded tiny demo pair from scratch, in one command.

    python -m dflash2_mlx.training.build_demo_pair            # the real build, into dflash2_mlx/assets
    python -m dflash2_mlx.training.build_demo_pair --quick    # a smoke test in a few minutes (into a temp dir)
    python -m dflash2_mlx.training.build_demo_pair --verify   # seconds: assets and stdlib vs MANIFEST.json
    python -m dflash2_mlx.training.build_demo_pair --check    # rebuild in a temp dir, compare sha256s

Steps: corpus (the stdlib's own .py files, deterministic split) -> byte-level BPE tokenizer ->
target (mlx-lm qwen3_5 hybrid, next-token training) -> the target's greedy continuations of
corpus prefixes -> DFlash 2 drafter trained on them -> evaluation on held-out prompts
(acceptance length at temperature 0 with the identical-to-autoregressive check, at temperature
0.7, and a prompt-lookup n-gram baseline; held-out perplexity; repetition rate) -> the assets
directory and ``MANIFEST.json``.

Everything is fixed: seeds, step counts (never a wall-clock budget), thread counts, and the
order of every list. MLX on the CPU is deterministic for a fixed op sequence, so the same
command on the same machine kind reproduces the committed weights bit for bit (``--check``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

os.environ.setdefault("RAYON_NUM_THREADS", "2")  # the tokenizers trainer; merges are order-independent anyway

import numpy as np  # noqa: E402

from dflash2_mlx.backend import blas as _blas  # noqa: E402  (OpenBLAS before mlx.core)
from dflash2_mlx.training import corpus as corpus_mod  # noqa: E402
from dflash2_mlx.training import tokenizer as tok_mod  # noqa: E402

THREADS = 2
TARGET_DIR = "tiny-code-demo-target"
DRAFTER_DIR = "tiny-code-demo-drafter"


@dataclass
class BuildPlan:
    """Every knob of a build. ``FULL`` is the committed pair; ``QUICK`` a smoke test."""

    name: str
    seed: int = 0
    vocab_size: int = 2048
    # target
    target_model: dict = field(default_factory=lambda: dict(
        hidden_size=256, num_layers=6, intermediate_size=448, full_attention_interval=3,
        attention_heads=4, kv_heads=2, head_dim=32, linear_key_heads=2, linear_value_heads=4, linear_head_dim=32,
    ))
    target_steps: int = 500
    target_batch: int = 4
    seq_len: int = 512
    target_lr: float = 3e-3
    target_warmup: int = 25
    heldout_eval_sequences: Optional[int] = None  # None: every held-out sequence
    # data: drop verbatim copies of files (and of chat examples); chat examples
    # (corpus.function_examples): share of functions, longest function in lines, plain-English
    # requests made from docstrings beside the signature form
    deduplicate: bool = False
    chat_percent: int = 20
    chat_max_lines: int = 40
    chat_requests: bool = False
    json_percent: int = 0  # share of public functions also described as JSON (corpus.json_examples)
    # drafter data and training
    drafter_sequences: int = 2048
    # more sequences continued by sampling at drafter_sample_temperature (a drafter for sampled
    # decoding sees sampled contexts); soft targets: drafter_options soft_target_weight
    drafter_sampled_sequences: int = 0
    drafter_sample_temperature: float = 0.7
    prefix_len: int = 96
    continuation_len: int = 128
    drafter_steps: int = 1500
    drafter_layers: int = 2
    drafter_block_size: int = 8
    drafter_taps: list = field(default_factory=lambda: [1, 3])
    drafter_options: dict = field(default_factory=dict)  # extra DrafterTrainingConfig fields
    # evaluation
    num_prompts: int = 24
    eval_max_tokens: int = 128
    sample_temperature: float = 0.7


# The committed pair: deduplicated data, 40% of the functions as chat examples (with plain-English
# requests) so answers end their turn, 3 M target tokens (1500 steps: ~1600 tok/s on a quiet
# 2-core machine), and a drafter distilled on the target's whole distribution over greedy and
# sampled continuations (so it drafts for chat temperatures too).
FULL = BuildPlan(
    name="full", target_steps=1500, target_warmup=50,
    deduplicate=True, chat_percent=40, chat_max_lines=30, chat_requests=True,
    json_percent=20,
    drafter_sequences=2560, drafter_sampled_sequences=2560, drafter_steps=3000,
    drafter_options={"soft_target_weight": 0.5, "feature_cache_bytes": 6 << 30},
)
# The recipe of the previous committed pair (greedy continuations, labels only, 500 target steps).
PREVIOUS = BuildPlan(name="previous")
QUICK = dataclasses.replace(
    FULL, name="quick", target_steps=12, target_warmup=3, heldout_eval_sequences=16,
    drafter_sequences=32, drafter_sampled_sequences=32, prefix_len=32, continuation_len=32, drafter_steps=10,
    num_prompts=4, eval_max_tokens=32,
)


def fix_threads(n: int = THREADS) -> str:
    """Pin the BLAS to the build's thread count; says what runs (recorded in MANIFEST)."""
    return _blas.set_threads(n)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Log:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Metrics


def repetition_rate(tokens: list[int], n: int = 4) -> tuple[int, int]:
    """(repeated, total) n-grams of ``tokens``: an n-gram is repeated if it occurred earlier."""
    seen, repeated, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        total += 1
        if gram in seen:
            repeated += 1
        seen.add(gram)
    return repeated, total


def prompt_lookup_draft(history: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup drafting: the k tokens that followed the latest earlier occurrence of the
    longest trailing n-gram (n = max_ngram..1) of ``history``; [] when none recurs."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        pattern = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == pattern:
                draft = history[start + n : start + n + k]
                if draft:
                    return draft
    return []


def prompt_lookup_acceptance(prompt: list[int], output: list[int], block_size: int) -> tuple[int, int]:
    """(cycle tokens, cycles) of speculative decoding at temperature 0 with a prompt-lookup
    drafter, replayed against the target's greedy ``output`` (which it would reproduce exactly):
    the first token comes from the prefill; each cycle drafts block_size - 1 tokens, accepts the
    prefix that matches and adds the target's bonus token."""
    history, pos, cycles, emitted = list(prompt) + output[:1], 1, 0, 0
    while pos < len(output):
        draft = prompt_lookup_draft(history, block_size - 1)
        a = 0
        while a < len(draft) and pos + a < len(output) and draft[a] == output[pos + a]:
            a += 1
        new = output[pos : pos + a + 1]
        history += new
        pos += len(new)
        emitted += len(new)
        cycles += 1
    return emitted, cycles


# ---------------------------------------------------------------------------------------------
# Stages


def build_corpus(plan: BuildPlan, log: Log):
    files = corpus_mod.load_corpus()
    unique = corpus_mod.deduplicate(files) if plan.deduplicate else files
    train, held = corpus_mod.split(unique)
    log(f"corpus: {len(files)} files, {len(files) - len(unique)} verbatim copies dropped "
        f"({len(train)} train, {len(held)} held out), "
        f"{sum(f.size for f in train) / 1e6:.2f} MB train, Python {sys.version.split()[0]}")
    return files, train, held


def build_tokenizer(plan: BuildPlan, train, out_dir: Path, log: Log):
    tok = tok_mod.train_tokenizer([f.text for f in train], vocab_size=plan.vocab_size)
    tok_mod.save_tokenizer(tok, out_dir)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, specials {tok_mod.special_ids(tok)}")
    return tok


def build_documents(plan: BuildPlan, tok, train, held, log: Log):
    """Training documents (one per file, then the chat examples) and held-out documents."""
    file_docs = tok_mod.encode_plain(tok, [f.text for f in train])
    chat, seen = [], set()
    for f in train:
        for user, answer in corpus_mod.function_examples(f, plan.chat_percent, plan.chat_max_lines, plan.chat_requests):
            if not plan.deduplicate or (user, answer) not in seen:  # the same function in two files is one example
                seen.add((user, answer))
                chat.append((user, answer))
    if plan.json_percent:
        for f in train:
            for user, answer in corpus_mod.json_examples(f, plan.json_percent):
                if not plan.deduplicate or (user, answer) not in seen:
                    seen.add((user, answer))
                    chat.append((user, answer))
    chat_docs = tok_mod.chat_ids_batch(tok, chat)
    held_docs = tok_mod.encode_plain(tok, [f.text for f in held])
    n_file, n_chat = sum(map(len, file_docs)), sum(map(len, chat_docs))
    log(f"documents: {n_file} file tokens + {n_chat} chat-example tokens ({len(chat_docs)} examples), "
        f"{sum(map(len, held_docs))} held-out tokens")
    stats = {"train_file_tokens": n_file, "train_chat_tokens": n_chat, "chat_examples": len(chat_docs),
             "heldout_tokens": sum(map(len, held_docs))}
    return file_docs + chat_docs, held_docs, stats


def build_target(plan: BuildPlan, tok, docs, held_docs, tok_dir: Path, out_dir: Path, log: Log) -> dict:
    from dflash2_mlx.training import target_trainer as tt

    eos = tok.token_to_id(tok_mod.EOS)
    im_end = tok.token_to_id(tok_mod.IM_END)
    config = tt.model_config(tok.get_vocab_size(), [eos, im_end], **plan.target_model)
    config["text_config"]["eos_token_id"] = eos
    size = tt.float32_bytes(config)
    log(f"target: {size / 1e6:.2f} MB float32, config {plan.target_model}")
    train_seqs = tt.pack_documents(docs, plan.seq_len, eos)
    held_seqs = tt.pack_documents(held_docs, plan.seq_len, eos)
    if plan.heldout_eval_sequences is not None:
        held_seqs = held_seqs[: plan.heldout_eval_sequences]
    tcfg = tt.TargetTrainingConfig(
        steps=plan.target_steps, batch_size=plan.target_batch, seq_len=plan.seq_len,
        learning_rate=plan.target_lr, warmup_steps=plan.target_warmup, seed=plan.seed,
    )
    model = tt.build_model(config, seed=plan.seed)
    t0 = time.perf_counter()
    history = tt.train_target(model, train_seqs, tcfg, log=log, log_every=max(1, min(25, plan.target_steps // 4)))
    seconds = time.perf_counter() - t0
    held_loss = tt.evaluate_loss(model, held_seqs, batch_size=16)
    log(f"target: trained {plan.target_steps} steps in {seconds:.0f}s; held-out loss {held_loss:.4f} "
        f"(perplexity {np.exp(held_loss):.2f}) over {held_seqs.shape[0] * plan.seq_len} tokens")
    (tok_dir / "generation_config.json").write_text(json.dumps(generation_config([eos, im_end]), indent=2) + "\n")
    tt.save_target(model, config, tok_dir, out_dir)
    return {
        "config": config,
        "model": plan.target_model,
        "parameters": tt.parameter_count(model),
        "float32_bytes": size,
        "training": tcfg.to_dict(),
        "training_tokens": plan.target_steps * plan.target_batch * plan.seq_len,
        "train_sequences": int(train_seqs.shape[0]),
        "epochs": round(plan.target_steps * plan.target_batch / train_seqs.shape[0], 3),
        "loss_history": history,
        "final_train_loss": history[-1]["loss"] if history else None,
        "heldout_loss": held_loss,
        "heldout_perplexity": float(np.exp(held_loss)),
        "heldout_tokens_evaluated": int(held_seqs.shape[0] * plan.seq_len),
        "train_seconds": round(seconds, 1),
    }


def drafter_data(plan: BuildPlan, target, docs) -> np.ndarray:
    """The drafter's training sequences [N, prefix_len + continuation_len]: corpus prefixes with
    the target's greedy continuations (seed plan.seed + 1), then sampled ones (plan.seed + 2)."""
    from dflash2_mlx.training.data import generate_training_sequences

    seqs = generate_training_sequences(
        target, docs, plan.drafter_sequences, plan.prefix_len, plan.continuation_len, plan.seed + 1,
    )
    if plan.drafter_sampled_sequences:
        sampled = generate_training_sequences(
            target, docs, plan.drafter_sampled_sequences, plan.prefix_len, plan.continuation_len, plan.seed + 2,
            temperature=plan.drafter_sample_temperature,
        )
        seqs = np.concatenate([seqs, sampled])
    return seqs


def build_drafter(plan: BuildPlan, target, docs, work: Path, log: Log) -> dict:
    try:
        from dflash2_mlx.training.drafter_trainer import DrafterTrainingConfig, train_drafter
    except ImportError as e:
        raise SystemExit(
            f"the drafter trainer is not available ({e}); the target is built, the drafter is not"
        ) from None
    t0 = time.perf_counter()
    seqs = drafter_data(plan, target, docs)
    gen_seconds = time.perf_counter() - t0
    log(f"drafter data: {seqs.shape[0]} sequences ({plan.drafter_sampled_sequences} sampled at "
        f"t={plan.drafter_sample_temperature}) of {plan.prefix_len} corpus + {plan.continuation_len} "
        f"generated tokens in {gen_seconds:.0f}s")
    cfg = DrafterTrainingConfig(
        block_size=plan.drafter_block_size, layers=plan.drafter_layers, steps=plan.drafter_steps,
        seed=plan.seed, convs=True, selector=True, target_layer_ids=list(plan.drafter_taps),
        **plan.drafter_options,
    )
    out = work / DRAFTER_DIR
    if out.exists():
        shutil.rmtree(out)  # never resume a half-finished run silently: the build starts clean
    t0 = time.perf_counter()
    train_drafter(target, seqs, out, cfg, continuation_start=plan.prefix_len, progress=sys.stderr.isatty())
    train_seconds = time.perf_counter() - t0
    log(f"drafter: trained {plan.drafter_steps} steps in {train_seconds:.0f}s")
    state = {}
    state_file = out / "training_state" / "state.json"
    if state_file.exists():
        try:
            state = json.loads(state_file.read_text())
        except json.JSONDecodeError:
            state = {}
    return {
        "training": {k: v for k, v in dataclasses.asdict(cfg).items()},
        "data": {"sequences": int(seqs.shape[0]), "sampled_sequences": plan.drafter_sampled_sequences,
                 "sample_temperature": plan.drafter_sample_temperature, "prefix_len": plan.prefix_len,
                 "continuation_len": plan.continuation_len, "seed": plan.seed + 1,
                 "sha256": hashlib.sha256(np.ascontiguousarray(seqs).tobytes()).hexdigest()},
        "loss_history": state.get("history", []),
        "generation_seconds": round(gen_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "dir": out,
    }


def evaluate(plan: BuildPlan, target_dir: Path, drafter_dir: Optional[Path], prompts: list[dict], log: Log) -> dict:
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.engine import GenerationSettings, collect, generate_autoregressive, generate_speculative
    from dflash2_mlx.models.loading import load_drafter, load_target

    target = load_target(str(target_dir))
    drafter = load_drafter(str(drafter_dir)) if drafter_dir is not None else None
    tokenizer = target.tokenizer
    stops = sorted(tokenizer.eos_token_ids)

    greedy = GenerationSettings(max_tokens=plan.eval_max_tokens, block_size=plan.drafter_block_size, stop_token_ids=stops)
    sampled = dataclasses.replace(greedy, sampling=SamplingSettings(temperature=plan.sample_temperature))
    rows = []
    totals = {"rep": [0, 0], "ref_rep": [0, 0], "g": [0, 0], "s": [0, 0], "pl": [0, 0]}
    identical = True
    ar_time = spec_time = 0.0
    ar_tokens = spec_tokens = 0
    for i, p in enumerate(prompts):
        ids = tokenizer.encode(p["prompt"], add_special_tokens=False)
        ar, ar_stats = collect(generate_autoregressive(target.runner, ids, greedy, tokenizer))
        row = {"source": p["source"], "prompt_tokens": len(ids), "generated": len(ar)}
        rep = repetition_rate(ar)
        ref = repetition_rate(p.get("reference_ids", [])[: len(ar)])
        row["repetition_4gram"] = rep[0] / rep[1] if rep[1] else 0.0
        for key, val in (("rep", rep), ("ref_rep", ref)):
            totals[key][0] += val[0]
            totals[key][1] += val[1]
        emitted, cycles = prompt_lookup_acceptance(ids, ar, plan.drafter_block_size)
        totals["pl"][0] += emitted
        totals["pl"][1] += cycles
        row["prompt_lookup_acceptance"] = emitted / cycles if cycles else 1.0
        ar_time += ar_stats.decode_seconds
        ar_tokens += max(len(ar) - 1, 0)
        if drafter is not None:
            spec, st = collect(generate_speculative(target.runner, drafter, ids, greedy, tokenizer))
            same = spec == ar
            if not same:
                first = next((j for j, (a, b) in enumerate(zip(spec, ar)) if a != b), min(len(spec), len(ar)))
                row["first_divergence"] = first
            identical &= same
            row.update(identical=same, acceptance_length=st.acceptance_length, verify_steps=st.verify_steps)
            totals["g"][0] += st.cycle_tokens
            totals["g"][1] += st.verify_steps
            spec_time += st.decode_seconds
            spec_tokens += max(st.generation_tokens - 1, 0)
            s_settings = dataclasses.replace(sampled, seed=plan.seed + i)
            _, ss = collect(generate_speculative(target.runner, drafter, ids, s_settings, tokenizer))
            row["acceptance_length_t07"] = ss.acceptance_length
            totals["s"][0] += ss.cycle_tokens
            totals["s"][1] += ss.verify_steps
        rows.append(row)
        if drafter is not None:
            log(f"eval {i + 1}/{len(prompts)} {p['source']}: acceptance {row['acceptance_length']:.2f} (t=0) "
                f"{row['acceptance_length_t07']:.2f} (t={plan.sample_temperature}), prompt lookup "
                f"{row['prompt_lookup_acceptance']:.2f}, identical {row['identical']}")

    def ratio(pair):
        return pair[0] / pair[1] if pair[1] else None

    result = {
        "prompts": len(prompts),
        "max_tokens": plan.eval_max_tokens,
        "block_size": plan.drafter_block_size,
        "repetition_rate_4gram": ratio(totals["rep"]),
        "reference_repetition_rate_4gram": ratio(totals["ref_rep"]),
        "prompt_lookup_acceptance_length": ratio(totals["pl"]),
        "ar_decode_tps": ar_tokens / ar_time if ar_time else None,
        "per_prompt": rows,
    }
    if drafter is not None:
        result.update({
            "acceptance_length_t0": ratio(totals["g"]),
            "acceptance_length_t07": ratio(totals["s"]),
            "sample_temperature": plan.sample_temperature,
            "identical_to_autoregressive": identical,
            "spec_decode_tps": spec_tokens / spec_time if spec_time else None,
        })
    return result


# Everyday chat requests a newcomer types first (the chat-defaults evaluation below).
CHAT_PROMPTS = (
    "Write a function that returns the maximum of a list.",
    "Write a function that reverses a string.",
    "Write a function that checks whether a number is prime.",
    "How do I read a file line by line?",
    "Write a class for a stack with push and pop methods.",
)

# What `chat` and the server use for the demo pair when the user sets nothing
# (generation_config.json): sampling, because a tiny target's greedy output loops; a modest cap.
CHAT_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 256}


def generation_config(eos_ids: list[int]) -> dict:
    """The target's generation_config.json: its end tokens and the demo pair's chat defaults."""
    return {"eos_token_id": list(eos_ids), **CHAT_DEFAULTS}


def evaluate_defaults(target_dir: Path, drafter_dir: Optional[Path], code_prompts: list[str], seed: int = 0,
                      log: Optional[Log] = None) -> dict:
    """The pair as a user first meets it, at its generation_config.json defaults: the chat
    prompts (chat template, generation prompt) and the raw code prompts, one seeded sample each.
    Per set: the 4-gram repetition rate (repeated / all generated 4-grams, pooled) and the share
    of answers that ended (emitted an end token) within ``max_new_tokens``."""
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.engine import GenerationSettings, collect, generate_autoregressive, generate_speculative
    from dflash2_mlx.models.loading import load_drafter, load_target

    cfg = json.loads((Path(target_dir) / "generation_config.json").read_text())
    target = load_target(str(target_dir))
    drafter = load_drafter(str(drafter_dir)) if drafter_dir is not None else None
    tok = target.tokenizer
    sampling = SamplingSettings(temperature=float(cfg.get("temperature", 0.0)) if cfg.get("do_sample", True) else 0.0,
                                top_p=float(cfg.get("top_p", 1.0)))
    max_tokens = int(cfg.get("max_new_tokens", 256))
    stops = sorted(tok.eos_token_ids)
    sets = {
        "chat": [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
                 for p in CHAT_PROMPTS],
        "code": [tok.encode(p, add_special_tokens=False) for p in code_prompts],
    }
    result = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": max_tokens, "seed": seed}
    for name, prompts in sets.items():
        repeated = total = ended = 0
        answers = []
        for i, ids in enumerate(prompts):
            settings = GenerationSettings(max_tokens=max_tokens, sampling=sampling, seed=seed + i, stop_token_ids=stops)
            if drafter is not None:
                out, _ = collect(generate_speculative(target.runner, drafter, list(ids), settings, tok))
            else:
                out, _ = collect(generate_autoregressive(target.runner, list(ids), settings, tok))
            r, t = repetition_rate(out)
            repeated, total = repeated + r, total + t
            stopped = bool(out) and out[-1] in stops
            ended += stopped
            if name == "chat":
                answers.append({"prompt": CHAT_PROMPTS[i], "tokens": len(out), "ended": stopped,
                                "repetition_4gram": r / t if t else 0.0, "text": tok.decode(out)})
        result[name] = {"prompts": len(prompts), "repetition_rate_4gram": repeated / total if total else 0.0,
                        "ended_share": ended / len(prompts) if prompts else 0.0}
        if answers:
            result[name]["answers"] = answers
        if log:
            log(f"defaults ({name}): repetition {_pct(result[name]['repetition_rate_4gram'])}, "
                f"ended {ended}/{len(prompts)}")
    return result


# ---------------------------------------------------------------------------------------------
# READMEs


def target_readme(m: dict) -> str:
    t = m["target"]
    cfg = t["model"]
    return f"""# tiny-code-demo-target

A **tiny code-completion demo model** shipped inside `dflash2-mlx` so that every command works in
seconds with no download. It is NOT a useful language model: it continues Python code in the
style of the standard library, often wrongly, and it cannot follow instructions.

- Architecture: mlx-lm `qwen3_5` (Qwen3.5 hybrid): {cfg['num_layers']} layers, hidden {cfg['hidden_size']},
  Gated DeltaNet layers and one gated attention layer in every {cfg['full_attention_interval']}, vocabulary
  {t['config']['text_config']['vocab_size']} (byte-level BPE), untied LM head, float32,
  {t['parameters'] / 1e6:.2f} M parameters ({t['float32_bytes'] / 1e6:.1f} MB).
- Training data: the Python {m['python_version']} standard library's own source (tests excluded),
  {m['corpus']['num_files'] - m['corpus']['num_held_out']} files, plus ChatML examples made from its functions;
  {t['training_tokens'] / 1e6:.2f} M training tokens ({t['epochs']} epochs).
- Held-out perplexity: {t['heldout_perplexity']:.2f} per token on {m['corpus']['num_held_out']} held-out stdlib files.
- Repetition rate of its greedy outputs (repeated 4-grams): {_pct(m['evaluation'].get('repetition_rate_4gram'))}.
- Chat: ChatML (`<|im_start|>role ... <|im_end|>`); it answers with a Python function and is
  trained to end its turn with `<|im_end|>` (not every answer does, below). Special tokens: `<|endoftext|>` (eos), `<|im_start|>`, `<|im_end|>`,
  `<|mask|>` (the drafter's mask token).
- Defaults (`generation_config.json`, used by `chat` and the server): {_defaults_line(m)}.

Built by `{m['command']}` (seed {m['seed']}); the record of the
build (corpus sha256s, seeds, step counts, measured results) is `../MANIFEST.json`, and
`docs/embedded-pair.md` explains how to rebuild and verify it.
"""


def drafter_readme(m: dict) -> str:
    d = m.get("drafter") or {}
    e = m["evaluation"]
    tr = d.get("training", {})
    return f"""# tiny-code-demo-drafter

The **DFlash 2 drafter for the tiny code-completion demo target** (`../tiny-code-demo-target`),
shipped inside `dflash2-mlx` so that speculative decoding works in seconds with no download. It
only makes sense with that target; it is a demonstration of the method, not a useful model.

- DFlash 2 block drafter: {tr.get('layers')} layers, block size {tr.get('block_size')}, two-tap dynamic
  convolutions and the candidate selector, taps target layers {tr.get('target_layer_ids')}, mask token
  `<|mask|>`, float32. It shares the target's embedding and LM head (not stored here).
- Trained with the project's own trainer on the target's own continuations of stdlib prefixes
  ({_data_line(d.get('data', {}))}, {tr.get('steps')} steps{_soft_line(tr)}).
- What each DFlash 2 part buys at this scale: `docs/embedded-pair.md`, "Ablation".
- Acceptance length on {e['prompts']} held-out prompts, block size {e['block_size']}:
  {_num(e.get('acceptance_length_t0'))} at temperature 0 (output identical to plain decoding:
  {e.get('identical_to_autoregressive')}), {_num(e.get('acceptance_length_t07'))} at temperature
  {e.get('sample_temperature')}; a prompt-lookup n-gram drafter gets {_num(e.get('prompt_lookup_acceptance_length'))}.

Built by `{m['command']}` (seed {m['seed']}); see `../MANIFEST.json`.
"""


def _data_line(data: dict) -> str:
    sampled = data.get("sampled_sequences") or 0
    total = data.get("sequences")
    if not sampled:
        return f"{total} greedy sequences"
    return f"{total} sequences: {total - sampled} greedy, {sampled} sampled at t={data.get('sample_temperature')}"


def _soft_line(training: dict) -> str:
    weight = training.get("soft_target_weight")
    return f", soft targets: the target's full distributions at weight {weight}" if weight else ""


def _defaults_line(m: dict) -> str:
    d = m["evaluation"].get("defaults")
    if not d:
        return ", ".join(f"{k} {v}" for k, v in CHAT_DEFAULTS.items())
    return (f"temperature {d['temperature']}, top-p {d['top_p']}, {d['max_tokens']} tokens per answer, since greedily it "
            f"loops; at these defaults {_pct(d['chat']['repetition_rate_4gram'])} of the 4-grams of its chat answers repeat "
            f"and {_pct(d['chat']['ended_share'])} of them end their turn")


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


# ---------------------------------------------------------------------------------------------
# The build


def default_assets_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "assets"


CHECKED_FILES = [
    f"{TARGET_DIR}/model.safetensors", f"{TARGET_DIR}/config.json", f"{TARGET_DIR}/tokenizer.json",
    f"{TARGET_DIR}/tokenizer_config.json", f"{DRAFTER_DIR}/model.safetensors", f"{DRAFTER_DIR}/config.json",
    "prompts.jsonl",
]


def build(plan: BuildPlan, out: Path, work: Path, target_only: bool = False) -> dict:
    log = Log()
    t_start = time.perf_counter()
    threads = fix_threads()
    import mlx.core as mx

    log(f"build '{plan.name}' -> {out} (work {work}); BLAS: {_blas.status}, {threads}")
    timings = {}
    t = time.perf_counter()
    files, train, held = build_corpus(plan, log)
    tok_dir = work / "tokenizer"
    tok = build_tokenizer(plan, train, tok_dir, log)
    docs, held_docs, doc_stats = build_documents(plan, tok, train, held, log)
    prompts = corpus_mod.prompt_prefixes(held, plan.num_prompts)
    for p in prompts:  # the held-out text that really follows, for the reference repetition rate
        p["reference_ids"] = tok_mod.encode_plain(tok, [p["reference"]])[0]
    timings["data_seconds"] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    target_work = work / TARGET_DIR
    # A kept --work directory reuses a finished target of the same inputs (a failed drafter stage
    # need not retrain it); the result is the same either way, training is deterministic.
    stage_key = {
        "plan": {k: getattr(plan, k) for k in ("seed", "vocab_size", "target_model", "target_steps", "target_batch",
                                              "seq_len", "target_lr", "target_warmup", "heldout_eval_sequences",
                                              "deduplicate", "chat_percent", "chat_max_lines", "chat_requests")},
        "corpus": corpus_mod.manifest(files)["list_sha256"],
        "tokenizer": sha256_file(tok_dir / "tokenizer.json"),
        "documents": hashlib.sha256(np.concatenate([np.asarray(d, dtype=np.int32) for d in docs]).tobytes()).hexdigest(),
    }
    stage_file = work / "target_stage.json"
    target_info, target_seconds = None, None
    if stage_file.exists() and (target_work / "model.safetensors").exists():
        record = json.loads(stage_file.read_text())
        if record.get("key") == stage_key and record.get("weights") == sha256_file(target_work / "model.safetensors"):
            target_info = record["info"]
            target_seconds = record.get("seconds")
            log(f"target: reusing the finished target in {target_work}")
    if target_info is None:
        target_info = build_target(plan, tok, docs, held_docs, tok_dir, target_work, log)
        target_seconds = round(time.perf_counter() - t, 1)
        stage_file.write_text(json.dumps({"key": stage_key, "info": target_info, "seconds": target_seconds,
                                          "weights": sha256_file(target_work / "model.safetensors")}, default=_json_default))
    else:  # the stage's own time when it ran (a rerun of the build would spend it again)
        timings["target_reused"] = True
    timings["target_seconds"] = target_seconds

    from dflash2_mlx.models.loading import load_target

    target = load_target(str(target_work))
    drafter_info = None
    if not target_only:
        t = time.perf_counter()
        drafter_info = build_drafter(plan, target, docs, work, log)
        timings["drafter_seconds"] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    drafter_work = drafter_info["dir"] if drafter_info else None
    evaluation = evaluate(plan, target_work, drafter_work, prompts, log)
    timings["evaluation_seconds"] = round(time.perf_counter() - t, 1)
    timings["total_seconds"] = round(time.perf_counter() - t_start + (target_seconds or 0.0 if timings.get("target_reused") else 0.0), 1)

    # Assemble the assets directory.
    out.mkdir(parents=True, exist_ok=True)
    dst_target = out / TARGET_DIR
    if dst_target.exists():
        shutil.rmtree(dst_target)
    shutil.copytree(target_work, dst_target)
    if drafter_work is not None:
        dst_drafter = out / DRAFTER_DIR
        if dst_drafter.exists():
            shutil.rmtree(dst_drafter)
        dst_drafter.mkdir()
        shutil.copyfile(drafter_work / "model.safetensors", dst_drafter / "model.safetensors")
        # The trainer's config, named as the demo drafter it is (loaders ignore the extra keys).
        raw = json.loads((drafter_work / "config.json").read_text())
        named = {"name": DRAFTER_DIR, "_name_or_path": DRAFTER_DIR, **{k: v for k, v in raw.items() if k not in ("name", "_name_or_path")}}
        (dst_drafter / "config.json").write_text(json.dumps(named, indent=2) + "\n")
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p["prompt"]}, ensure_ascii=False) + "\n")

    import mlx_lm
    import tokenizers

    manifest = {
        "name": "tiny-code-demo",
        "description": "Tiny code-completion demo pair (Qwen3.5-architecture hybrid target + DFlash 2 drafter) "
                       "trained on the Python standard library; for demos and tests, not a useful model.",
        "build": plan.name,
        "command": "python -m dflash2_mlx.training.build_demo_pair" + {"quick": " --quick", "previous": " --plan previous"}.get(plan.name, ""),
        "seed": plan.seed,
        "plan": {k: v for k, v in dataclasses.asdict(plan).items()},
        "python_version": sys.version.split()[0],
        "environment": {
            "python": sys.version.split()[0], "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "tokenizers": tokenizers.__version__, "numpy": np.__version__, "platform": platform.platform(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "blas": _blas.status, "threads": threads,
        },
        "corpus": corpus_mod.manifest(files),
        "documents": doc_stats,
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "special_tokens": tok_mod.special_ids(tok),
                      "sha256": sha256_file(tok_dir / "tokenizer.json")},
        "target": {k: v for k, v in target_info.items()},
        "drafter": {k: v for k, v in (drafter_info or {}).items() if k != "dir"} or None,
        "prompts": [{"source": p["source"], "chars": len(p["prompt"])} for p in prompts],
        "evaluation": evaluation,
        "timings": timings,
    }
    # What ships must load as shipped (names, extra config keys, tokenizer files).
    from dflash2_mlx.models.loading import load_drafter, validate_pair

    shipped = load_target(str(dst_target))
    if drafter_work is not None:
        validate_pair(shipped.runner, load_drafter(str(out / DRAFTER_DIR)).config, shipped.name)
    t = time.perf_counter()
    evaluation["defaults"] = evaluate_defaults(dst_target, out / DRAFTER_DIR if drafter_work is not None else None,
                                               [p["prompt"] for p in prompts], plan.seed, log)
    timings["defaults_evaluation_seconds"] = round(time.perf_counter() - t, 1)
    (dst_target / "README.md").write_text(target_readme(manifest))
    if drafter_work is not None:
        (out / DRAFTER_DIR / "README.md").write_text(drafter_readme(manifest))
    manifest["files"] = {name: sha256_file(out / name) for name in CHECKED_FILES if (out / name).exists()}
    manifest["files_bytes"] = {
        p.relative_to(out).as_posix(): p.stat().st_size
        for p in sorted(out.rglob("*")) if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts
    }
    manifest["total_bytes"] = sum(manifest["files_bytes"].values())
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, default=_json_default) + "\n")
    log(f"done in {timings['total_seconds']:.0f}s: {summary(manifest)}")
    return manifest


def record_defaults(out: Path) -> dict:
    """Measure the assets in ``out`` at their chat defaults (``evaluate_defaults``) and record the
    result, the shipped generation_config.json's size and the time taken in MANIFEST.json."""
    fix_threads()
    path = out / "MANIFEST.json"
    m = json.loads(path.read_text())
    prompts = [json.loads(line)["prompt"] for line in (out / "prompts.jsonl").read_text().splitlines() if line.strip()]
    t = time.perf_counter()
    m["evaluation"]["defaults"] = evaluate_defaults(out / TARGET_DIR, out / DRAFTER_DIR, prompts, m["seed"], Log())
    m["timings"]["defaults_evaluation_seconds"] = round(time.perf_counter() - t, 1)
    (out / TARGET_DIR / "README.md").write_text(target_readme(m))
    for name in (f"{TARGET_DIR}/generation_config.json", f"{TARGET_DIR}/README.md"):
        m["files_bytes"][name] = (out / name).stat().st_size
    m["total_bytes"] = sum(m["files_bytes"].values())
    path.write_text(json.dumps(m, indent=1, default=_json_default) + "\n")
    return m["evaluation"]["defaults"]


def _json_default(x):
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def summary(m: dict) -> str:
    e, t = m["evaluation"], m["target"]
    parts = [
        f"target {t['parameters'] / 1e6:.2f}M params, held-out ppl {t['heldout_perplexity']:.2f}",
        f"repetition {_pct(e.get('repetition_rate_4gram'))} (reference text {_pct(e.get('reference_repetition_rate_4gram'))})",
        f"prompt-lookup acceptance {_num(e.get('prompt_lookup_acceptance_length'))}",
    ]
    if "acceptance_length_t0" in e:
        parts.append(f"DFlash 2 acceptance {_num(e['acceptance_length_t0'])} (t=0, identical "
                     f"{e['identical_to_autoregressive']}), {_num(e['acceptance_length_t07'])} (t={e['sample_temperature']})")
    parts.append(f"assets {m['total_bytes'] / 1e6:.1f} MB")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Verification


def verify(out: Path) -> list[str]:
    """Problems found comparing the assets and this machine's stdlib with MANIFEST.json (fast)."""
    path = out / "MANIFEST.json"
    if not path.exists():
        return [f"{path} does not exist"]
    m = json.loads(path.read_text())
    problems = []
    for name, digest in m.get("files", {}).items():
        f = out / name
        if not f.exists():
            problems.append(f"{name}: missing")
        elif sha256_file(f) != digest:
            problems.append(f"{name}: sha256 differs from the manifest")
    current = corpus_mod.manifest(corpus_mod.load_corpus())
    problems += [f"corpus: {d}" for d in corpus_mod.compare_manifests(m.get("corpus", {}), current)]
    return problems


def check(plan: BuildPlan, out: Path, work: Optional[Path]) -> int:
    """Rebuild into a temporary directory and compare every checked file's sha256 with the manifest."""
    recorded = json.loads((out / "MANIFEST.json").read_text())
    if recorded.get("build") != plan.name:
        print(f"the manifest records a '{recorded.get('build')}' build; run --check with the same mode", file=sys.stderr)
        return 2
    corpus_diff = corpus_mod.compare_manifests(recorded["corpus"], corpus_mod.manifest(corpus_mod.load_corpus()))
    if corpus_diff:
        print("warning: this machine's stdlib differs from the recorded corpus, the weights will differ:\n  "
              + "\n  ".join(corpus_diff), file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="dflash2-check-") as tmp:
        fresh = Path(tmp) / "assets"
        rebuilt = build(plan, fresh, work or Path(tmp) / "work")
    bad = [name for name, digest in recorded["files"].items() if rebuilt["files"].get(name) != digest]
    for name in recorded["files"]:
        status = "differs" if name in bad else "identical"
        print(f"{status:9s} {name}")
    print("check passed: the rebuild reproduced the recorded files bit for bit" if not bad else
          f"check FAILED: {len(bad)} file(s) differ (same machine kind? same Python, mlx, tokenizers?)")
    return 1 if bad else 0


def model_card(m: dict) -> str:
    """A markdown model card from a MANIFEST.json (for docs/embedded-pair.md)."""
    t, e, d = m["target"], m["evaluation"], m.get("drafter") or {}
    files = m.get("files_bytes", {})
    tb = files.get(f"{TARGET_DIR}/model.safetensors", 0)
    db = files.get(f"{DRAFTER_DIR}/model.safetensors", 0)
    rows = [
        ("build", f"`{m['command']}` (seed {m['seed']}), Python {m['python_version']}, mlx {m['environment']['mlx']}, "
                  f"mlx-lm {m['environment']['mlx_lm']}, tokenizers {m['environment']['tokenizers']}"),
        ("corpus", f"{m['corpus']['num_files']} stdlib files ({m['corpus']['num_held_out']} held out), "
                   f"{m['corpus']['bytes'] / 1e6:.2f} MB; corpus list sha256 `{m['corpus']['list_sha256'][:16]}...`"),
        ("tokenizer", f"byte-level BPE, vocabulary {m['tokenizer']['vocab_size']}"),
        ("target", f"qwen3_5 hybrid, {t['model']['num_layers']} layers (attention every "
                   f"{t['model']['full_attention_interval']}), hidden {t['model']['hidden_size']}, "
                   f"{t['parameters'] / 1e6:.2f} M parameters, {tb / 1e6:.1f} MB float32"),
        ("target training", f"{t['training']['steps']} steps x {t['training']['batch_size']} x "
                            f"{t['training']['seq_len']} tokens = {t['training_tokens'] / 1e6:.2f} M tokens "
                            f"({t['epochs']} epochs), {t['train_seconds'] / 60:.1f} min; final train loss "
                            f"{_num(t.get('final_train_loss'))}"),
        ("held-out perplexity", f"{t['heldout_perplexity']:.2f} (loss {t['heldout_loss']:.3f} nats/token over "
                                f"{t['heldout_tokens_evaluated']} tokens)"),
        ("repetition rate (greedy, 4-grams)", f"{_pct(e.get('repetition_rate_4gram'))} (the real held-out "
                                              f"continuations: {_pct(e.get('reference_repetition_rate_4gram'))})"),
    ]
    if d:
        tr = d["training"]
        rows += [
            ("drafter", f"DFlash 2, {tr['layers']} layers, block {tr['block_size']}, taps {tr['target_layer_ids']}, "
                        f"{db / 1e6:.1f} MB float32"),
            ("drafter training", f"{tr['steps']} steps on {d['data']['sequences']} sequences "
                                 f"({d['data']['prefix_len']} corpus + {d['data']['continuation_len']} target-generated "
                                 f"tokens); generation {d['generation_seconds'] / 60:.1f} min, training "
                                 f"{d['train_seconds'] / 60:.1f} min"),
            ("acceptance length, t = 0", f"{_num(e.get('acceptance_length_t0'))} (identical to plain decoding: "
                                         f"{e.get('identical_to_autoregressive')})"),
            (f"acceptance length, t = {e.get('sample_temperature')}", _num(e.get("acceptance_length_t07"))),
        ]
    dflt = e.get("defaults")
    if dflt:
        setting = f"t = {dflt['temperature']}, top-p {dflt['top_p']}, max_tokens {dflt['max_tokens']}"
        rows += [
            (f"at the chat defaults ({setting}): {dflt['chat']['prompts']} chat prompts",
             f"repetition {_pct(dflt['chat']['repetition_rate_4gram'])}, answers that end their turn "
             f"{_pct(dflt['chat']['ended_share'])}"),
            (f"at the chat defaults: {dflt['code']['prompts']} code prompts",
             f"repetition {_pct(dflt['code']['repetition_rate_4gram'])}, ended with an end token "
             f"{_pct(dflt['code']['ended_share'])}"),
        ]
    rows += [
        ("prompt-lookup n-gram drafter, t = 0", _num(e.get("prompt_lookup_acceptance_length"))),
        ("evaluation", f"{e['prompts']} held-out prompts, {e['max_tokens']} new tokens each, block size {e['block_size']}"),
        ("build time", f"{m['timings']['total_seconds'] / 60:.1f} min on {m['environment']['cpu_count']} cores "
                       f"({m['environment']['machine']})"),
        ("assets", f"{m['total_bytes'] / 1e6:.1f} MB"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash2_mlx.training.build_demo_pair", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="assets directory to write (default: dflash2_mlx/assets; with --quick: a new temp dir)")
    ap.add_argument("--work", type=Path, default=None, help="keep intermediate files here (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny step counts: a smoke test in a few minutes")
    ap.add_argument("--plan", choices=["full", "previous"], default="full",
                    help="full: the committed pair's recipe; previous: the recipe of the pair before it")
    ap.add_argument("--target-only", action="store_true", help="stop after the target (no drafter)")
    ap.add_argument("--verify", action="store_true", help="compare the assets and the stdlib with MANIFEST.json")
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare sha256s with MANIFEST.json")
    ap.add_argument("--card", action="store_true", help="print the model card (markdown) of the MANIFEST.json in --out")
    ap.add_argument("--evaluate-defaults", action="store_true",
                    help="measure the pair in --out at its generation_config.json defaults and record it in MANIFEST.json")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else {"full": FULL, "previous": PREVIOUS}[args.plan]
    out = args.out
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="dflash2-quick-")) if (args.quick and not (args.verify or args.check or args.card)) else default_assets_dir()
    if args.card:
        print(model_card(json.loads((out / "MANIFEST.json").read_text())), end="")
        return 0
    if args.evaluate_defaults:
        record_defaults(out)
        return 0
    if args.verify:
        problems = verify(out)
        for p in problems:
            print(p)
        print("verify passed" if not problems else f"verify found {len(problems)} problem(s)")
        return 1 if problems else 0
    if args.check:
        return check(plan, out, args.work)
    if args.work is not None:
        build(plan, out, args.work, target_only=args.target_only)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash2-build-") as tmp:
            build(plan, out, Path(tmp), target_only=args.target_only)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
