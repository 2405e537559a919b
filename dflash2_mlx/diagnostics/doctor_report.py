"""The acceptance report (``dflash2-mlx doctor --report FILE``): one JSON file a Mac user attaches.

Sections: ``system`` (chip, memory, OS, versions, backend), ``kernels`` (built or not, the
self-check of each kernel per dtype, timings against the reference ops), ``rollback`` (the active
path), ``lossless`` (greedy speculative against plain decoding over N prompts, each divergence
with its position, the target's top-2 logit gap there and whether it is within the measured
rounding bound; a verdict), ``speed`` (decode tok/s plain, at a fixed block and with the engine's
default block setting, plus acceptance) and ``memory`` (peak, wired limit, the pre-flight plan).

The exactness rule it applies is the project's claim: on the CPU in float32 a verify row's logits
equal a plain step's up to float32 rounding, so output is token for token plain decoding's; on
Metal with bf16 or quantized weights a B-row verify and a 1-row step run different matmul kernels
and round differently, so output equals plain decoding up to floating-point near-ties. A
divergence passes only where the target's top-2 gap at that position is within the rounding
bound measured here (twice the largest difference between verify-row and plain-step logits).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx

from dflash2_mlx.backend import device
from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.kernels import dispatch as kernels
from dflash2_mlx.kernels import plans, reference, selfcheck
from dflash2_mlx.models import drafter_precision, memory

# Generic prompts for pairs with a chat template (the embedded code pair brings its own).
CHAT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in three sentences why the sky is blue.",
    "List five uses of a binary search tree, one line each.",
    "Translate to French: The library opens at nine and closes at six.",
    "What is 17 times 23? Show the steps.",
    "Write a haiku about a mountain lake at dawn.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Write a SQL query that finds the ten customers with the highest total order value.",
    "Give three tips for writing clear commit messages.",
    "Describe how a hash map handles collisions.",
)


@dataclass
class ReportOptions:
    prompts: int = 8
    tokens: int = 256  # per prompt, lossless section
    speed_tokens: int = 1024
    long: bool = False
    long_tokens: int = 8192
    probes: int = 4  # positions sampled for the rounding bound
    repeats: int = 2  # speed rounds per mode (alternating order)


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def system_section() -> dict:
    from dflash2_mlx import __version__
    from dflash2_mlx.backend import blas

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    has, source = memory.available_bytes()
    return {
        "chip": info.get("device_name") or platform.processor() or platform.machine(),
        "architecture": info.get("architecture"),
        "memory_bytes": info.get("memory_size"),
        "recommended_working_set_bytes": info.get("max_recommended_working_set_size"),
        "memory_for_models_bytes": has,
        "memory_source": source,
        "os": platform.platform(),
        "python": platform.python_version(),
        "dflash2_mlx": __version__,
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "backend": device.backend(),
        "default_device": str(mx.default_device()),
        "blas": blas.status if device.backend() == "CPU" else "not used (GPU backend)",
        "gpu_paths_forced": device.forced_gpu_paths(),
    }


def time_us(fn: Callable, iters: int = 10, warmup: int = 2) -> list[float]:
    """Sorted wall times (microseconds) of ``mx.eval(fn())``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) * 1e6)
    return sorted(samples)


def _median_us(fn: Callable) -> float:
    return round(statistics.median(time_us(fn)), 1)


def kernels_section(dtypes: Sequence[mx.Dtype]) -> dict:
    """Self-checks for the model's dtypes, then each kernel timed against its reference ops at
    the self-check's real widths (Metal timings only where the kernel runs)."""
    metal = kernels._metal_device() and not kernels._forced_reference()
    active = kernels.prepare(dtypes)
    timings = {}
    for name in reference.KERNEL_NAMES:
        args = selfcheck.check_args(name, mx.float32)
        entry = {"reference_us": _median_us(lambda: reference.REFERENCES[name](*args)), "metal_us": None}
        if metal and active[name].startswith("metal"):
            plan = plans.PLANNERS[name](*args)
            entry["metal_us"] = _median_us(lambda: plan.finish(kernels._run_metal(plan)))
        timings[name] = entry
    return {
        "metal_available": bool(metal),
        "compiled": bool(metal) and any(v.startswith("metal") for v in active.values()),
        "active": active,
        "self_checks": kernels.self_checks(),
        "check_widths": dict(selfcheck.CHECK_WIDTHS),
        "timings_float32": timings,
    }


def rollback_section(runner) -> dict:
    from dflash2_mlx.caches.target import rollback_setting

    return {
        "setting": rollback_setting(),
        "path": runner.rollback_path(),
        "rule": "keep: the verify pass keeps each step's Gated DeltaNet state; replay: rollback "
        "replays the recurrence from the pass's recorded inputs; trim: attention only",
    }


# ---------------------------------------------------------------------------------------------
# Lossless


def _tokens(events) -> tuple[list[int], object]:
    tokens, stats = [], None
    for event in events:
        tokens += event.tokens
        stats = event.stats or stats
    return tokens, stats


def top2_gap(runner, tokens: Sequence[int]) -> float:
    """The target's gap between its two largest next-token logits after ``tokens``."""
    logits, _ = runner(mx.array([list(tokens)]), runner.make_cache(), logits_from=len(tokens) - 1)
    top = mx.topk(logits[0, -1].astype(mx.float32), 2)
    return abs(float(top[0]) - float(top[1]))


def rounding_bound(runner, probes: Sequence[tuple[list[int], list[int]]], rows: int) -> dict:
    """Twice the largest |verify-row logit - plain-step logit| over the probes (prefix, next
    tokens): the same positions fed as one ``rows``-row verify pass and as 1-row steps from the
    same cache. A greedy choice can flip only where the top-2 gap is below it."""
    worst = 0.0
    for prefix, following in probes:
        block = following[:rows]
        if not block:
            continue
        cache = runner.make_cache()
        runner(mx.array([prefix]), cache, logits_from=len(prefix))
        snap = cache.snapshot()
        verify, _ = runner(mx.array([block]), cache, record=[])
        cache.restore(snap)
        steps = mx.concatenate([runner(mx.array([[t]]), cache)[0] for t in block], axis=1)
        worst = max(worst, float(mx.max(mx.abs(verify.astype(mx.float32) - steps.astype(mx.float32)))))
    return {"max_logit_difference": worst, "bound": 2 * worst, "rows": rows, "probes": len(probes)}


def divergence(
    runner, prompt: Sequence[int], plain: Sequence[int], spec: Sequence[int], bound: float
) -> Optional[dict]:
    """None when ``spec`` is ``plain``; else where they part, the target's top-2 logit gap there
    and whether it is within ``bound`` (a longer or shorter output is never within it)."""
    if list(spec) == list(plain):
        return None
    i = next((j for j, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
    if i >= len(plain) or i >= len(spec):
        return {"position": i, "top2_gap": None, "within_bound": False}
    gap = top2_gap(runner, list(prompt) + list(plain[:i]))
    return {"position": i, "top2_gap": gap, "within_bound": gap <= bound}


def verdict_of(divergences: Sequence[dict]) -> str:
    """ "pass" when every divergence is a near-tie within the rounding bound."""
    return "pass" if all(d["within_bound"] for d in divergences) else "fail"


def lossless_section(target, drafter, prompts: Sequence[list[int]], options: ReportOptions) -> dict:
    runner = target.runner
    settings = GenerationSettings(max_tokens=options.tokens)  # no stop tokens: fixed lengths
    outputs = []
    for ids in prompts:
        plain, _ = _tokens(generate_autoregressive(runner, ids, settings))
        spec, stats = _tokens(generate_speculative(runner, drafter, ids, settings))
        outputs.append((ids, plain, spec, stats))
    step = max(1, options.tokens // max(1, options.probes))
    probes = [
        (ids + plain[:p], plain[p:])
        for ids, plain, _, _ in outputs[:2]
        for p in range(0, max(1, len(plain) - drafter.config.block_size), step)
    ][: options.probes]
    bound = rounding_bound(runner, probes, drafter.config.block_size)
    results, divergences = [], []
    for n, (ids, plain, spec, stats) in enumerate(outputs):
        entry = {
            "prompt": n,
            "prompt_tokens": len(ids),
            "tokens": len(plain),
            "identical": spec == plain,
            "acceptance_length": round(stats.acceptance_length, 3),
        }
        found = divergence(runner, ids, plain, spec, bound["bound"])
        if found is not None:
            entry.update(found)
            divergences.append({"prompt": n, **found})
        results.append(entry)
    identical = sum(r["identical"] for r in results)
    verdict = verdict_of(divergences)
    return {
        "prompts": len(results),
        "tokens_per_prompt": options.tokens,
        "identical": identical,
        "divergence_rate": (len(results) - identical) / len(results) if results else 0.0,
        "rounding": bound,
        "divergences": divergences,
        "per_prompt": results,
        "verdict": verdict,
        "rule": "a divergence passes only where the target's top-2 logit gap at that position is "
        "within the rounding bound (CPU float32: float32 rounding, about 1e-5, so output is identical "
        "but for an exact tie)",
    }


# ---------------------------------------------------------------------------------------------
# Speed


def _run(runner, drafter, ids, tokens: int, block: Optional[int], plain: bool) -> dict:
    settings = GenerationSettings(max_tokens=tokens, block_size=block)
    events = (
        generate_autoregressive(runner, ids, settings)
        if plain
        else generate_speculative(runner, drafter, ids, settings)
    )
    out, stats = _tokens(events)
    return {
        "generated": len(out),
        "decode_tps": stats.decode_tps,
        "acceptance_length": round(stats.acceptance_length, 3) if not plain else 1.0,
    }


def _median_run(samples: list[dict]) -> dict:
    return {
        **samples[0],
        "decode_tps": round(statistics.median(s["decode_tps"] for s in samples), 2),
        "decode_tps_samples": [round(s["decode_tps"], 2) for s in samples],
    }


def speed_section(target, drafter, prompt: list[int], options: ReportOptions) -> dict:
    """Plain, fixed block and the engine's default block setting, interleaved in one run (so
    their ratios are same-run ratios; ``options.repeats`` rounds in alternating order, medians),
    at ``speed_tokens`` and with ``long`` at ``long_tokens`` generated tokens (capped by the
    model's context)."""
    runner = target.runner
    fixed = drafter.config.block_size
    modes = {"plain": (None, True), f"block_{fixed}": (fixed, False), "auto": (None, False)}
    lengths = [options.speed_tokens] + ([options.long_tokens] if options.long else [])
    for block, plain in modes.values():  # warm-up: compiles every trace
        _run(runner, drafter, prompt, 32, block, plain)
    runs = []
    for n in lengths:
        limit = (runner.max_context or n + len(prompt) + 1) - len(prompt) - 1
        tokens = min(n, limit)
        samples: dict = {name: [] for name in modes}
        for r in range(options.repeats):
            for name in list(modes) if r % 2 == 0 else reversed(list(modes)):
                samples[name].append(_run(runner, drafter, prompt, tokens, *modes[name]))
        entry = {"requested_tokens": n, "generated_tokens": tokens, "capped_by_context": tokens < n}
        entry.update({name: _median_run(s) for name, s in samples.items()})
        base = entry["plain"]["decode_tps"]
        entry["speedup_block"] = round(entry[f"block_{fixed}"]["decode_tps"] / base, 3) if base else None
        entry["speedup_auto"] = round(entry["auto"]["decode_tps"] / base, 3) if base else None
        runs.append(entry)
    return {
        "fixed_block": fixed,
        "repeats": options.repeats,
        "auto": "the engine's default block setting (--block-size not given); a block-size "
        "controller, when the engine has one, is what this measures",
        "runs": runs,
    }


def memory_section(target, drafter) -> dict:
    models = [target.runner.model] + ([drafter] if drafter is not None else [])
    has, source = memory.available_bytes()
    try:
        plan = memory.preflight(str(target.path), str(drafter.path) if drafter is not None else None)
    except memory.DoesNotFit:
        plan = None
    return {
        "peak_bytes": mx.get_peak_memory(),
        "active_bytes": mx.get_active_memory(),
        "weights_bytes": sum(memory.tree_bytes(m) for m in models),
        "wired_limit_bytes": memory.wired_limit(),
        "memory_for_models_bytes": has,
        "memory_source": source,
        "preflight_plan": plan.as_dict() if plan is not None else None,
    }


def build_report(
    target,
    drafter,
    prompts: Sequence[list[int]],
    label: str,
    options: Optional[ReportOptions] = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """The whole report for a loaded pair over ``prompts`` (token ids; at least one)."""
    options = options or ReportOptions()
    mx.reset_peak_memory()
    report = {"pair": label, "options": vars(options).copy(), "system": system_section()}
    report["system"]["drafter_precision"] = drafter_precision.describe(drafter)  # e.g. "w4a32 ...; why: ..."
    # how many token ids the drafter's head scores (None: the whole vocabulary)
    vocab = drafter.draft_vocab
    report["system"]["drafter_draft_vocab"] = None if vocab is None else int(vocab.shape[0])
    progress("kernels: self-checks and timings")
    report["kernels"] = kernels_section(kernels.float_dtypes([target.runner.model.parameters(), drafter.parameters()]))
    report["rollback"] = rollback_section(target.runner)
    progress(f"lossless: {len(prompts)} prompts x {options.tokens} tokens, speculative and plain")
    report["lossless"] = lossless_section(target, drafter, prompts, options)
    progress("speed: plain, fixed block and auto")
    report["speed"] = speed_section(target, drafter, list(prompts[0]), options)
    report["memory"] = memory_section(target, drafter)
    report["verdict"] = report["lossless"]["verdict"]
    return report


def write_report(report: dict, path) -> None:
    from pathlib import Path

    Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")
