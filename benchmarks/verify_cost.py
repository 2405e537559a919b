"""The verify cost curve: one target pass over B tokens against one pass over 1 token, B = 1..16.

    python benchmarks/verify_cost.py [--model smollm2] [--context 256] [--rounds 7] [--weight-copies auto]
                                     [--json out.json]

Measured with the project's own runner (``TargetRunner``, as a verify pass calls it: with the
drafter's tapped layers), after a prefill of ``--context`` tokens; each pass is rolled back by
trimming the KV cache, so every pass sees the same context. Each round visits every B once, in a
shuffled order, and times a 1-token pass right before each B-token pass: the ratio reported is the
median over rounds of those adjacent pairs' t(B) / t(1). Contention from other processes only adds
time, so the ratio of the fastest passes, min t(B) / min t(1), is printed beside it. On a CPU a
GGUF target runs in float32. ``--weight-copies on|off`` forces the runner's row-major weight copies
for block-sized passes on or off (``auto``: where ``blas.row_major_copies_pay`` says they pay).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import dflash2_mlx  # noqa: F401  (the optimised BLAS before mlx.core)

# isort: split


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="target (default: smollm2)")
    ap.add_argument("--context", type=int, default=256, help="tokens in the cache before each pass")
    ap.add_argument("--max-block", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--weight-copies", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import mlx.core as mx

    from dflash2_mlx.models.loading import load_target
    from dflash2_mlx.models.target import TargetRunner

    target = load_target(args.model)
    runner = target.runner
    if args.weight_copies != "auto":
        runner = TargetRunner(runner.model, block_weight_copies=args.weight_copies == "on")
    taps = [1, runner.num_layers // 2, runner.num_layers - 2]  # a drafter's usual spread of taps
    rng = random.Random(0)
    vocab = runner.vocab_size or 1000
    cache = runner.make_cache()
    logits, _ = runner(mx.array([[rng.randrange(vocab) for _ in range(args.context)]]), cache)
    mx.eval(logits)

    def one_pass(block: int) -> float:
        tokens = mx.array([[rng.randrange(vocab) for _ in range(block)]])
        start = time.perf_counter()
        logits, features = runner(tokens, cache, taps)
        mx.eval(logits, features)
        elapsed = time.perf_counter() - start
        cache.rollback([], block, 0)  # plain attention: a KV trim
        return elapsed

    blocks = list(range(1, args.max_block + 1))
    for block in blocks:  # warm-up: every shape once
        one_pass(block)
    ratios: dict[int, list[float]] = {b: [] for b in blocks}
    times: dict[int, list[float]] = {b: [] for b in blocks}
    for _ in range(args.rounds):
        order = blocks[:]
        rng.shuffle(order)
        for b in order:
            one = one_pass(1)
            this = one_pass(b)
            times[1].append(one)
            times[b].append(this)
            ratios[b].append(this / one)
    rows = []
    fastest_one = min(times[1])
    copies = "row-major copies" if runner.block_weight_copies else "weight views"
    print(f"{target.name}: {runner.num_layers} layers, context {args.context}, {args.rounds} rounds, {copies}")
    print(f"{'B':>3} {'ms (min)':>9} {'ms (median)':>12} {'paired t(B)/t(1)':>17} {'spread':>12} {'min/min':>8}")
    for b in blocks:
        ratio, fastest = statistics.median(ratios[b]), min(times[b]) / fastest_one
        spread = f"{min(ratios[b]):.2f}..{max(ratios[b]):.2f}"
        print(
            f"{b:>3} {1000 * min(times[b]):>9.1f} {1000 * statistics.median(times[b]):>12.1f} {ratio:>17.2f} "
            f"{spread:>12} {fastest:>8.2f}"
        )
        rows.append(
            {
                "block": b,
                "ms_min": 1000 * min(times[b]),
                "ms_median": 1000 * statistics.median(times[b]),
                "paired_ratio": ratio,
                "paired_min": min(ratios[b]),
                "paired_max": max(ratios[b]),
                "min_over_min": fastest,
            }
        )
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
