"""What plain decoding costs inside the speculative loop: its plain steps against plain decoding.

    python benchmarks/plain_steps.py [--draft-model D [--model M]] [--max-tokens 256] [--long 3000]
                                     [--repeats 5] [--json out.json]

When no block size pays, the break-even controller decodes with plain steps (cycles of size 1)
inside the speculative loop, so that the target features of those tokens still reach the drafter's
context. This measures what that costs against ``generate_autoregressive``, with no controller in
the way: the loop runs with a schedule of plain steps only (``ScheduledBlocks([1])``), on the
first prompt of the embedded prompt set and on a held-out text of about ``--long`` tokens, greedy
and at t = 0.7. Each round runs both back to back (order alternating); the ratio reported is the
median over rounds of the same round's decode tok/s ratio, with its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target (default: the embedded target)")
    ap.add_argument("--draft-model", help="drafter (default: the embedded drafter)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--long", type=int, default=3000, help="tokens of the long prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).parent))
    from long_context import held_out_tokens

    from dflash2_mlx.cli.common import embedded_pair, embedded_prompts, encode_line
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.engine import GenerationSettings, collect, generate_autoregressive, generate_speculative
    from dflash2_mlx.models.loading import load_drafter, load_target
    from dflash2_mlx.policies.block_size import ScheduledBlocks

    target_path, drafter_path = embedded_pair()
    target = load_target(args.model or str(target_path))
    drafter = load_drafter(args.draft_model or str(drafter_path))
    tok, runner = target.tokenizer, target.runner
    prompts = {
        "prompt set (1)": encode_line(tok, embedded_prompts()[0]),
        f"long ({args.long} tokens)": held_out_tokens(tok, args.long),
    }

    def run(mode: str, ids, temperature: float, max_tokens: int):
        sampling = SamplingSettings(temperature=temperature)
        if mode == "plain decoding":
            return collect(
                generate_autoregressive(
                    runner, ids, GenerationSettings(max_tokens=max_tokens, sampling=sampling, seed=0)
                )
            )
        settings = GenerationSettings(max_tokens=max_tokens, sampling=sampling, seed=0, policy=ScheduledBlocks([1]))
        return collect(generate_speculative(runner, drafter, ids, settings))

    report = {"settings": vars(args) | {"json": str(args.json) if args.json else None}, "cells": []}
    modes = ("plain decoding", "plain steps in the loop")
    for temperature in (0.0, 0.7):
        for name, ids in prompts.items():
            for mode in modes:  # warm-up
                run(mode, ids, temperature, 16)
            tps = {m: [] for m in modes}
            for r in range(args.repeats):
                for mode in modes if r % 2 == 0 else modes[::-1]:
                    tokens, stats = run(mode, ids, temperature, args.max_tokens)
                    tps[mode].append(stats.decode_tps)
                    if mode == modes[0]:
                        reference = tokens
                    elif temperature == 0 and tokens != reference:
                        raise SystemExit("plain steps in the loop did not reproduce plain decoding")
            ratios = [b / a for a, b in zip(*tps.values())]
            cell = {
                "temperature": temperature,
                "prompt": name,
                "plain_tps_median": statistics.median(tps[modes[0]]),
                "loop_tps_median": statistics.median(tps[modes[1]]),
                "ratio_median": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                # best of the runs: what each path does when the machine leaves it alone
                "ratio_of_best": max(tps[modes[1]]) / max(tps[modes[0]]),
            }
            report["cells"].append(cell)
            print(
                f"T={temperature:g} {name}: plain {cell['plain_tps_median']:.0f} tok/s, loop plain steps "
                f"{cell['loop_tps_median']:.0f} tok/s, ratio {cell['ratio_median']:.3f} "
                f"[{min(ratios):.3f}-{max(ratios):.3f}], best of each {cell['ratio_of_best']:.3f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
