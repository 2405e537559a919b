"""Does a speculative cycle stay cheap at long context? Cycle time / autoregressive step time at a
short and a long context, on the embedded pair (or --model/--draft-model).

    python benchmarks/long_context.py [--short 256] [--long 4000] [--max-tokens 96] [--repeats 3]
    python benchmarks/long_context.py --reduced-depth [--short 256] [--long 4096]

The contexts are held-out standard-library text (the embedded pair's own domain), cut to the
given token counts. Per context: one speculative and one plain run after a warm-up; cycle time =
speculative decode time / verify cycles; AR step = plain decode time / (tokens - 1). The drafter's
context is bounded by its sliding window, so the ratio should not grow with the context. The two
contexts are measured in turn ``--repeats`` times and each time is the median over the repeats, so
that a slow spell of a shared machine hits both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from harness import load_pair

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split


def held_out_tokens(tokenizer, count: int) -> list[int]:
    from dflash2_mlx.training import corpus

    _, held = corpus.split(corpus.load_corpus())
    ids: list[int] = []
    for f in held:
        ids += tokenizer.encode(f.text, add_special_tokens=False)
        if len(ids) >= count:
            return ids[:count]
    raise SystemExit(f"the held-out files hold only {len(ids)} tokens")


def measure(target, drafter, prompt: list[int], max_tokens: int) -> dict:
    from dflash2_mlx.engine import GenerationSettings, collect, generate_autoregressive, generate_speculative

    # no stop tokens: every run is max_tokens long; the fixed loop (cycle time = decode time / cycles)
    settings = GenerationSettings(max_tokens=max_tokens, block_size=drafter.config.block_size)

    def last(events):
        return collect(events)[1]

    last(generate_speculative(target.runner, drafter, prompt, GenerationSettings(max_tokens=8)))  # warm-up
    spec = last(generate_speculative(target.runner, drafter, prompt, settings))
    plain = last(generate_autoregressive(target.runner, prompt, settings))
    cycle_ms = 1000 * spec.decode_seconds / spec.verify_steps
    step_ms = 1000 * plain.decode_seconds / (plain.generation_tokens - 1)
    return {
        "context": len(prompt),
        "cycle_ms": cycle_ms,
        "ar_step_ms": step_ms,
        "cycle_over_step": cycle_ms / step_ms,
        "acceptance_length": spec.acceptance_length,
        "spec_tps": spec.decode_tps,
        "ar_tps": plain.decode_tps,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--short", type=int, default=256)
    ap.add_argument("--long", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--reduced-depth",
        action="store_true",
        help="Qwen3.8-27B / DFlash 2 widths at reduced depth, random weights, float32 "
        "(benchmarks/cost_model.py): cycle = draft + 8-row verify + rollback, "
        "AR step = a 1-row pass, at both contexts (about 18 GB of memory)",
    )
    args = ap.parse_args(argv)
    if args.reduced_depth:
        return reduced_depth(args.short, args.long, args.repeats)
    target, drafter = load_pair(args.model, args.draft_model)
    ids = held_out_tokens(target.tokenizer, args.long)
    runs = {args.short: [], len(ids): []}
    for _ in range(args.repeats):
        for n in runs:
            runs[n].append(measure(target, drafter, ids[:n], args.max_tokens))
    rows = []
    for n, results in runs.items():
        row = {k: statistics.median(r[k] for r in results) for k in results[0]}
        row["cycle_over_step"] = row["cycle_ms"] / row["ar_step_ms"]
        rows.append(row)
    for r in rows:
        print(
            f"context {r['context']:5d}: cycle {r['cycle_ms']:.1f} ms, AR step {r['ar_step_ms']:.1f} ms, "
            f"cycle / step {r['cycle_over_step']:.2f}, acceptance {r['acceptance_length']:.2f}"
        )
    change = rows[1]["cycle_over_step"] / rows[0]["cycle_over_step"] - 1
    print(f"cycle / step at {rows[1]['context']} vs {rows[0]['context']} tokens: {100 * change:+.1f}%")
    print(json.dumps({"rows": rows, "relative_change": change}))
    return 0


def reduced_depth(short: int, long: int, repeats: int) -> int:
    """The same ratio at the real widths, where the target's weights, not its attention over the
    context, set the cost of a pass (the embedded pair's hidden size is 256)."""
    import mlx.core as mx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cost_model

    runner, drafter = cost_model.build(mx.float32, None)
    rows = cost_model.cycle_and_step(runner, drafter, [short, long], repeats)
    for r in rows:
        print(
            f"context {r['context']:5d}: cycle {r['cycle_ms']:.0f} ms (draft {r['draft_ms']:.0f}, verify "
            f"{r['verify_8_ms']:.0f}, rollback {r['rollback_ms']:.1f}), AR step {r['ar_step_ms']:.0f} ms, "
            f"cycle / step {r['cycle_over_step']:.3f}"
        )
    change = rows[1]["cycle_over_step"] / rows[0]["cycle_over_step"] - 1
    print(f"cycle / step at {long} vs {short} tokens (real widths, reduced depth): {100 * change:+.1f}%")
    print(json.dumps({"rows": rows, "relative_change": change}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
