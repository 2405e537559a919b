"""The verify cost curve: one target pass over B tokens against one pass over 1 token, B = 1..16.

    python benchmarks/verify_cost.py [--model smollm2] [--context 256] [--rounds 7] [--json out.json]

Measured with the project's own runner (``TargetRunner``, as a verify pass calls it: with the
drafter's tapped layers), after a prefill of ``--context`` tokens; each pass is rolled back by
trimming the KV cache, so every pass sees the same context. Each round times every B once, in a
shuffled order, so contention from other processes spreads over all B alike; the ratio reported
is the median over rounds of the same round's t(B) / t(1). On a CPU a GGUF target runs in float32.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import dflash2_mlx  # noqa: F401  (the optimised BLAS before mlx.core)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="target (default: smollm2)")
    ap.add_argument("--context", type=int, default=256, help="tokens in the cache before each pass")
    ap.add_argument("--max-block", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import mlx.core as mx

    from dflash2_mlx.loading import load_target

    target = load_target(args.model)
    runner = target.runner
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
        measured = {b: one_pass(b) for b in order}
        for b in blocks:
            times[b].append(measured[b])
            ratios[b].append(measured[b] / measured[1])
    rows = []
    print(f"{target.name}: {runner.num_layers} layers, context {args.context}, {args.rounds} rounds")
    print(f"{'B':>3} {'ms (median)':>12} {'t(B)/t(1)':>10} {'spread':>16}")
    for b in blocks:
        ms, ratio = 1000 * statistics.median(times[b]), statistics.median(ratios[b])
        spread = f"{min(ratios[b]):.2f}..{max(ratios[b]):.2f}"
        print(f"{b:>3} {ms:>12.1f} {ratio:>10.2f} {spread:>16}")
        rows.append({"block": b, "ms": ms, "ratio": ratio, "min": min(ratios[b]), "max": max(ratios[b])})
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
