"""Side by side, in one process and one run: this project against z-lab's MLX DFlash and mlx-lm.

    python benchmarks/compare.py                       # the embedded tiny pair, its prompt set
    python benchmarks/compare.py --model M --draft-model D --prompts F.jsonl --max-tokens 256 --json out.json
    python benchmarks/compare.py --repeats 3      # best of 3 per prompt: for a busy machine

Implementations (each with its own copy of the target: z-lab's code wraps the target's layers to
capture hidden states, so no instance is shared):

- ``dflash2-mlx``       this project, speculative (``generate_speculative``)
- ``dflash2-mlx AR``    this project, plain decoding (``generate_autoregressive``)
- ``z-lab dflash``      PyPI ``dflash``: ``dflash.model_mlx.stream_generate`` (DFlash 1 and 2)
- ``mlx-lm AR``         ``mlx_lm.stream_generate`` with a greedy / temperature sampler
- ``mlx-lm speculative`` and ``dflash-mlx`` are tried and reported as not applicable with the
  reason when they cannot run this pair (mlx-lm's speculation needs a trimmable cache and a
  causal-LM draft; dflash-mlx runs DFlash 1 drafters only).

Every implementation is timed the same way, by wrapping its token stream: time to first token
from the call, and decode tok/s = (tokens - 1) / (time of the last token - time of the first).
One warm-up run each (not recorded), then per prompt the implementations run one after the
other, in an order that rotates between prompts; with ``--repeats N`` each prompt is run N times
per implementation (the order rotating again) and each implementation's fastest run is kept. Greedy token identity is checked against this
project's plain decoding (the lossless reference). Acceptance length = emitted cycle tokens /
verify cycles, for every speculative implementation.

z-lab's ``load_draft`` downloads from the Hub; for a local drafter directory the harness hands it
the directory in place of the download (a scoped patch of that one call, nothing else of theirs
is changed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional
from unittest import mock

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx


@dataclass
class Result:
    tokens: list[int]
    ttft: float
    decode_tps: float
    cycles: int = 0  # verify cycles (speculative only)
    cycle_tokens: int = 0
    peak_memory_gb: float = 0.0


@dataclass
class Implementation:
    name: str
    run: Optional[Callable[[list[int]], Result]]  # None: not applicable
    speculative: bool
    ar_of: Optional[str] = None  # the plain decoder its speedup is measured against
    reason: str = ""
    results: list[Result] = field(default_factory=list)


def timed(stream: Iterable, tokens_of: Callable, cycle_of: Callable = lambda item: None) -> Result:
    """Consume a token stream, timing it the same way for every implementation."""
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    first = last = None
    tokens: list[int] = []
    cycles = cycle_tokens = 0
    for item in stream:
        new = tokens_of(item)
        if not new:
            continue
        now = time.perf_counter()
        first = now if first is None else first
        last = now
        tokens += new
        emitted = cycle_of(item)
        if emitted is not None:
            cycles += 1
            cycle_tokens += emitted
    ttft = (first or t0) - t0
    tps = (len(tokens) - 1) / (last - first) if first is not None and last > first else 0.0
    return Result(tokens, ttft, tps, cycles, cycle_tokens, mx.get_peak_memory() / 1e9)


# ---------------------------------------------------------------------------------------------
# Implementations


def ours(
    model: str, draft_model: str, max_tokens: int, block_size: Optional[int], temperature: float
) -> list[Implementation]:
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.engine import GenerationSettings, generate_autoregressive, generate_speculative
    from dflash2_mlx.models.loading import load_drafter, load_target, validate_pair

    target = load_target(model)
    drafter = load_drafter(draft_model)
    validate_pair(target.runner, drafter.config, target.name)
    tok = target.tokenizer
    settings = GenerationSettings(
        max_tokens=max_tokens,
        block_size=block_size,
        seed=0,
        sampling=SamplingSettings(temperature=temperature),
        stop_token_ids=sorted(tok.eos_token_ids),
    )

    def spec(ids):
        return timed(
            generate_speculative(target.runner, drafter, ids, settings, tok),
            lambda e: e.tokens,
            lambda e: len(e.tokens) if e.accepted is not None else None,
        )

    def plain(ids):
        return timed(generate_autoregressive(target.runner, ids, settings, tok), lambda e: e.tokens)

    return [
        Implementation("dflash2-mlx", spec, True, ar_of="dflash2-mlx AR"),
        Implementation("dflash2-mlx AR", plain, False),
    ]


@contextmanager
def _local_snapshot(module):
    """z-lab's load_draft calls huggingface_hub.snapshot_download; a local directory is its own snapshot."""
    real = module.snapshot_download

    def snapshot(repo_id, **kwargs):
        return repo_id if Path(repo_id).is_dir() else real(repo_id, **kwargs)

    with mock.patch.object(module, "snapshot_download", snapshot):
        yield


def zlab(
    model: str, draft_model: str, max_tokens: int, block_size: Optional[int], temperature: float
) -> Implementation:
    try:
        import dflash.model_mlx as zm
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot run here"
        return Implementation("z-lab dflash", None, True, reason=f"cannot import dflash.model_mlx ({e})")
    target, tokenizer = zm.load(model)
    with _local_snapshot(zm):
        draft = zm.load_draft(draft_model)

    def run(ids):
        stream = zm.stream_generate(
            target, draft, tokenizer, ids, block_size=block_size, max_tokens=max_tokens, temperature=temperature
        )
        return timed(stream, lambda r: r.tokens, lambda r: r.accepted)

    return Implementation("z-lab dflash", run, True, ar_of="mlx-lm AR")


def mlx_lm_ar(model: str, max_tokens: int, temperature: float):
    """(implementation, its mlx-lm model, its tokenizer): the model is reused for mlx-lm's speculation."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    target, tokenizer = mlx_lm.load(model)
    sampler = make_sampler(temp=temperature)

    def run(ids):
        if temperature > 0:
            mx.random.seed(0)
        stream = mlx_lm.stream_generate(target, tokenizer, ids, max_tokens=max_tokens, sampler=sampler)
        return timed(stream, lambda r: [r.token])  # one response per token, the last one included

    return Implementation("mlx-lm AR", run, False), target, tokenizer


def mlx_lm_speculative(target, tokenizer, draft_model: str, max_tokens: int) -> Implementation:
    """mlx-lm's own draft-model speculation, where it accepts the pair (it needs a causal-LM
    draft and trimmable caches; a DFlash drafter is neither, and hybrid targets are not trimmable)."""
    import mlx_lm
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    name = "mlx-lm speculative"
    if not can_trim_prompt_cache(make_prompt_cache(target)):
        return Implementation(
            name,
            None,
            True,
            reason="the target's cache cannot be trimmed (Gated DeltaNet layers), "
            "which mlx-lm's speculative decoding requires",
        )
    try:
        draft, _ = mlx_lm.load(draft_model)
    except Exception as e:  # noqa: BLE001
        return Implementation(
            name, None, True, reason=f"mlx-lm cannot load the drafter as a model ({type(e).__name__})"
        )

    def run(ids):
        stream = mlx_lm.stream_generate(target, tokenizer, ids, max_tokens=max_tokens, draft_model=draft)
        return timed(stream, lambda r: [r.token])

    return Implementation(name, run, True, ar_of="mlx-lm AR")


def dflash_mlx(draft_model: str) -> Implementation:
    name = "dflash-mlx"
    try:
        import dflash_mlx  # noqa: F401
    except ImportError:
        return Implementation(name, None, True, reason="not installed (pip install dflash-mlx; DFlash 1 drafters only)")
    config = json.loads((Path(draft_model) / "config.json").read_text()) if Path(draft_model).is_dir() else {}
    if "DFlash2DraftModel" in (config.get("architectures") or []):
        return Implementation(name, None, True, reason="runs DFlash 1 drafters only; this drafter is DFlash 2")
    return Implementation(name, None, True, reason="DFlash 1 comparison not wired into this harness yet")


# ---------------------------------------------------------------------------------------------


def summarize(impls: list[Implementation], reference: str = "dflash2-mlx AR") -> dict:
    by_name = {i.name: i for i in impls}
    ref = by_name[reference].results
    rows = {}
    for impl in impls:
        if impl.run is None:
            rows[impl.name] = {"applicable": False, "reason": impl.reason}
            continue
        rs = impl.results
        tps = sum(r.decode_tps for r in rs) / len(rs)
        row = {
            "applicable": True,
            "decode_tps": tps,
            "ttft_s": sum(r.ttft for r in rs) / len(rs),
            "peak_memory_gb": max(r.peak_memory_gb for r in rs),
            "identical_to_reference": all(r.tokens == x.tokens for r, x in zip(rs, ref)),
            "tokens": sum(len(r.tokens) for r in rs),
        }
        if impl.speculative:
            cycles = sum(r.cycles for r in rs)
            row["acceptance_length"] = sum(r.cycle_tokens for r in rs) / cycles if cycles else None
        if impl.ar_of and by_name.get(impl.ar_of) and by_name[impl.ar_of].run is not None:
            ar = by_name[impl.ar_of].results
            row["speedup_over_own_ar"] = tps / (sum(r.decode_tps for r in ar) / len(ar))
            row["own_ar"] = impl.ar_of
        rows[impl.name] = row
    return rows


def table(rows: dict) -> str:
    head = f"{'implementation':20s} {'decode tok/s':>12s} {'accept':>7s} {'speedup':>8s} {'TTFT ms':>8s} {'peak GB':>8s}  identical"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        if not r["applicable"]:
            lines.append(f"{name:20s} n/a: {r['reason']}")
            continue
        acc = f"{r['acceptance_length']:.2f}" if r.get("acceptance_length") else "-"
        sp = f"{r['speedup_over_own_ar']:.2f}x" if r.get("speedup_over_own_ar") else "-"
        lines.append(
            f"{name:20s} {r['decode_tps']:12.1f} {acc:>7s} {sp:>8s} {1000 * r['ttft_s']:8.1f} "
            f"{r['peak_memory_gb']:8.3f}  {r['identical_to_reference']}"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded tiny code-completion demo target)")
    ap.add_argument("--draft-model", default=None, help="drafter (default: the embedded demo drafter)")
    ap.add_argument("--prompts", default=None, help='JSON lines of {"prompt": ...} (default: the embedded prompt set)')
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every prompt this many times per implementation and keep each one's "
        "fastest (a shared machine's slow spells then hit no implementation)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from dflash2_mlx import assets
    from dflash2_mlx.diagnostics.bench import read_prompts
    from dflash2_mlx.models.loading import freeze_loaded_objects

    model = args.model or str(assets.demo_target_path())
    draft_model = args.draft_model or str(assets.demo_drafter_path())
    lines = read_prompts(args.prompts) if args.prompts else [{"prompt": p} for p in assets.demo_prompts()]
    if any("prompt" not in line for line in lines):
        raise SystemExit('compare.py feeds raw prompts to every implementation; give lines with "prompt"')
    lines = lines[: args.num_prompts] if args.num_prompts else lines

    impls = ours(model, draft_model, args.max_tokens, args.block_size, args.temperature)
    impls.append(zlab(model, draft_model, args.max_tokens, args.block_size, args.temperature))
    ar, lm_target, lm_tok = mlx_lm_ar(model, args.max_tokens, args.temperature)
    impls.append(ar)
    impls.append(mlx_lm_speculative(lm_target, lm_tok, draft_model, args.max_tokens))
    impls.append(dflash_mlx(draft_model))
    prompts = [lm_tok.encode(line["prompt"], add_special_tokens=False) for line in lines]

    runnable = [i for i in impls if i.run is not None]
    # as the CLI does after loading: a full collection over the loaded objects would stall
    # whichever implementation is running at that moment for ~0.1 s
    freeze_loaded_objects()
    for impl in runnable:  # warm-up: compile, allocate, fault the weights in
        impl.run(prompts[0][:64])
    for k, ids in enumerate(prompts):
        best: dict = {}  # per implementation, its fastest of the repeats on this prompt
        for r in range(args.repeats):
            turn = (k + r) % len(runnable)
            for impl in runnable[turn:] + runnable[:turn]:
                result = impl.run(ids)
                if impl.name not in best or result.decode_tps > best[impl.name].decode_tps:
                    best[impl.name] = result
        for impl in runnable:
            impl.results.append(best[impl.name])
        print(f"prompt {k + 1}/{len(prompts)} done", file=sys.stderr, flush=True)

    rows = summarize(impls)
    print(table(rows))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "model": model,
                    "draft_model": draft_model,
                    "prompts": len(prompts),
                    "implementations": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
