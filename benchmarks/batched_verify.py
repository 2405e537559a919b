"""Batched verify on this machine: N requests decoded together, verify passes batched vs taken in turn.

    python benchmarks/batched_verify.py [--model M --draft-model D] [--concurrency 1 2 4]
                                        [--max-tokens 96] [--repeats 7] [--json out.json]

N speculative decodes (greedy, the embedded pair by default, N different held-out prompts) run
in lock step in one process, a cycle of each at a time (``batched_verify.step_together``). Each
such round runs batched (the N verify passes as one target call) or in turn (N calls), chosen by a
seeded coin, and is timed on its own: the two modes interleave round by round within every decode,
so a slow spell of this shared machine hits both alike. Only rounds in which every request ran a
decode cycle count. Reported per N: total tok/s in each mode (mean tokens per round / the median
round time; also tokens / time over all its rounds), per request (that / N, all running at
once), the median ms per round, the on / off ratio, the same by the process's CPU time per round
(all its threads: the work a round took, whatever else the machine ran),
and whether every output equals its solo run (it must: the mode changes no numbers). Also the
verify pass alone: one batched pass over N blocks of 8 rows against N passes (in turn, the fastest
of 15, and the number of MLX ops each runs).
"""

from __future__ import annotations

import argparse
import io
import random
import re
import statistics
import sys
import time
from pathlib import Path

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
from harness import load_pair, write_report
from mlx.utils import tree_flatten

from dflash2_mlx.decoding.batched_verify import VerifyRequest, step_together, verify_batch, verify_one
from dflash2_mlx.engine import GenerationSettings, collect, generate_speculative, prefill, speculative_steps


def op_count(*outputs: mx.array) -> int:
    """Primitives MLX would run to compute ``outputs`` from what is already evaluated."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return len(re.findall(r'label ="[A-Za-z]+', dot.getvalue()))


def load(args):
    from dflash2_mlx import assets
    from dflash2_mlx.backend.files import read_jsonl

    target, drafter = load_pair(args.model, args.draft_model)
    prompts_file = Path(args.prompts or assets.assets_dir() / assets.PROMPTS_FILE)
    prompts = [target.tokenizer.encode(line["prompt"]) for _, line in read_jsonl(prompts_file, "prompt file")]
    return target.runner, drafter, prompts


def decode_alternating(runner, drafter, prompts, settings, seed: int) -> tuple[dict, list[list[int]]]:
    """Decode the prompts together, each round (a cycle of every request) batched or not by a
    seeded coin, and time each round -> per mode [(seconds, tokens, process CPU seconds) per round], and each request's
    tokens. Only rounds in which every request ran a decode cycle count (not the prefill's)."""
    rng = random.Random(seed)
    loops = [speculative_steps(runner, drafter, p, settings) for p in prompts]
    tokens = [[] for _ in prompts]
    rounds = {True: [], False: []}  # per mode: (seconds, tokens, CPU seconds) of each counted round
    active = list(range(len(loops)))
    while active:
        batch = rng.random() < 0.5
        t0, cpu0 = time.perf_counter(), time.process_time()
        steps = step_together(runner, [loops[i] for i in active], batch)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        cycles = 0
        for i, step in zip(list(active), steps):
            if step.error is not None:
                raise step.error
            if step.ended:
                active.remove(i)
                continue
            tokens[i] += step.event.tokens
            cycles += step.event.accepted is not None
        if cycles == len(prompts):
            rounds[batch].append((seconds, sum(len(s.event.tokens) for s in steps), cpu))
    return rounds, tokens


def verify_pass_ms(runner, drafter, prompts, n: int, repeats: int) -> dict:
    """One batched verify of n blocks of 8 rows vs n solo verifies (prefilled contexts restored
    each time), timed in turn, the fastest of each."""
    settings = GenerationSettings(max_tokens=1)
    taps = drafter.config.target_layer_ids
    snaps = []
    for p in prompts[:n]:
        _, cache, _, _ = prefill(runner, p, settings)
        snaps.append((cache, cache.snapshot()))
    blocks = [mx.array([p[:8]], dtype=mx.int32) for p in prompts[:n]]

    def requests():
        for cache, snap in snaps:
            cache.restore(snap)
        return [VerifyRequest(b, c, taps, True) for b, (c, _) in zip(blocks, snaps)]

    def run(batched: bool, count: bool = False):
        reqs = requests()
        t0 = time.perf_counter()
        results = verify_batch(runner, reqs) if batched else [verify_one(runner, r) for r in reqs]
        # what a cycle reads: logits, features, and each cache's new conv windows and states
        outputs = [[r.logits, r.features] for r in results] + [
            [layer.keys, layer.values] if kind == "attention" else list(layer.cache)
            for c, _ in snaps
            for kind, layer in zip(c.kinds, c.layers)
        ]
        ops = op_count(*[a for _, a in tree_flatten(outputs)]) if count else None
        mx.eval(outputs)
        return ops if count else 1000 * (time.perf_counter() - t0)

    run(True), run(False)  # warm-up: traces for these shapes
    times = {True: [], False: []}
    for _ in range(repeats):
        for batched in (True, False):
            times[batched].append(run(batched))
    # the fastest of each: contention on a shared machine only ever adds time; and the op counts,
    # which on this CPU backend set a small model's pass time (every op costs ~5-15 us) and do
    # not depend on the machine's load
    return {
        "batched_ms": min(times[True]),
        "separate_ms": min(times[False]),
        "batched_ops": run(True, count=True),
        "separate_ops": run(False, count=True),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--prompts")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    runner, drafter, prompts = load(args)
    settings = GenerationSettings(max_tokens=args.max_tokens, block_size=args.block_size)
    solo = [collect(generate_speculative(runner, drafter, p, settings))[0] for p in prompts[: max(args.concurrency)]]
    rows = []
    for n in args.concurrency:
        group = prompts[:n]
        decode_alternating(runner, drafter, group, settings, seed=-1)  # warm-up: traces for batch n
        rounds = {True: [], False: []}
        identical = True
        for r in range(args.repeats):
            run, tokens = decode_alternating(runner, drafter, group, settings, seed=r)
            identical &= tokens == solo[:n]
            for mode in (True, False):
                rounds[mode] += run[mode]
        row = {"concurrency": n, "identical_to_solo": identical}
        for batch, label in ((True, "on"), (False, "off")):
            seconds, tokens, cpu = ([r[k] for r in rounds[batch]] for k in range(3))
            # a round's time is heavy-tailed on a shared machine (descheduled spells): the median
            # round against the mean tokens per round (which the mode does not change)
            median_s = statistics.median(seconds)
            row[label] = {
                "rounds": len(seconds),
                "ms_per_round_median": 1000 * median_s,
                "tokens_per_round": statistics.mean(tokens),
                "total_tps": statistics.mean(tokens) / median_s,
                "per_request_tps": statistics.mean(tokens) / median_s / n,
                "total_tps_all_time": sum(tokens) / sum(seconds),
                # CPU time of all this process's threads: what the round cost in work,
                # whatever else the shared machine ran meanwhile
                "cpu_ms_per_round_median": 1000 * statistics.median(cpu),
                "total_tps_by_cpu": statistics.mean(tokens) / statistics.median(cpu),
            }
        row["on_over_off"] = row["on"]["total_tps"] / row["off"]["total_tps"]
        row["on_over_off_by_cpu"] = row["on"]["total_tps_by_cpu"] / row["off"]["total_tps_by_cpu"]
        row["verify_pass"] = verify_pass_ms(runner, drafter, prompts, n, 15)
        rows.append(row)
        print(
            f"N={n}: on {row['on']['total_tps']:.1f} tok/s ({row['on']['per_request_tps']:.1f} per request), "
            f"off {row['off']['total_tps']:.1f} tok/s ({row['off']['per_request_tps']:.1f} per request), "
            f"on/off {row['on_over_off']:.2f}x (by CPU time {row['on_over_off_by_cpu']:.2f}x); "
            f"verify pass {row['verify_pass']['batched_ms']:.1f} ms batched vs "
            f"{row['verify_pass']['separate_ms']:.1f} ms separate ({row['verify_pass']['batched_ops']} vs "
            f"{row['verify_pass']['separate_ops']} ops); identical {row['identical_to_solo']}",
            file=sys.stderr,
        )
    report = {
        "settings": {
            "max_tokens": args.max_tokens,
            "block_size": args.block_size or drafter.config.block_size,
            "repeats": args.repeats,
        },
        "rows": rows,
    }
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
