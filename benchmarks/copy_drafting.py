"""Copy drafting against the drafter alone and plain decoding, on the prompt sets of issue 39.

    python benchmarks/copy_drafting.py [--model smollm2] [--sets edit,long,agent,chat]
        [--temps 0,0.7] [--max-tokens 200] [--limit N] [--json out.json]

For each prompt set and temperature, every prompt runs three ways back to back (the order
rotates per prompt, so drift hits them alike): plain decoding, the default mode (the break-even
controller choosing per cycle between the drafter's block, a copy of the context and a plain
step) and the drafter alone (the same controller with copy drafting off). A set's prompts run as
one client's requests: in the default mode they share one index of earlier answers, as a
server's requests under one API key do (``agent.jsonl`` is one session). Reported per cell:
speedups as ratios of mean decode tok/s measured in the same run, acceptance length, tokens
drafted and accepted by source, the share of tokens by mode, and whether outputs equal plain
decoding's (greedy; sampled too, since draws are keyed by seed and position) for every prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import dflash2_mlx  # noqa: F401  (the optimised BLAS before mlx.core)

# isort: split

from dflash2_mlx.caches.token_index import TokenIndex
from dflash2_mlx.cli.common import encode_line
from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.output import collect
from dflash2_mlx.decoding.sampling import SamplingSettings
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.diagnostics.bench import merge_controller, read_prompts
from dflash2_mlx.models.loading import load_drafter, load_target

PROMPTS = Path(__file__).parent / "prompts"
MODES = ("plain", "default", "drafter")
# A Mac's cycle costs in plain steps (DESIGN.md, "When speculation pays"): a verify pass of up to
# 32 rows of a 27B 4-bit target about 1.15 steps (a flat curve), a drafter's block about 0.25 more.
FLAT_VERIFY, DRAFTER_PASS = 1.15, 0.25


def flat_curve_speedup(controller: dict) -> float:
    """What the same cycles would give where verifying any block costs ``FLAT_VERIFY`` steps: the
    tokens they emitted over their cost in plain steps (the controller would also choose longer
    blocks there, so this is a floor at the acceptance measured here)."""
    tokens = sum(controller["tokens_by_mode"].values())
    plain = controller["block_sizes"].get("1", 0)
    blocks = sum(n for b, n in controller["block_sizes"].items() if b != "1")
    copies = sum(controller.get("copy_sizes", {}).values())
    steps = plain + blocks * (FLAT_VERIFY + DRAFTER_PASS) + copies * FLAT_VERIFY
    return tokens / steps if steps else 1.0


def run_cell(target, drafter, lines, temperature: float, max_tokens: int, seed: int) -> dict:
    tok = target.tokenizer
    sampling = SamplingSettings(temperature=temperature, top_p=0.9 if temperature else 1.0)
    base = GenerationSettings(
        max_tokens=max_tokens, sampling=sampling, seed=seed, stop_token_ids=sorted(tok.eos_token_ids)
    )
    session = TokenIndex(source="shared")
    settings = {
        "default": replace(base, copy_index=session),
        "drafter": replace(base, copy_drafting=False),
    }
    tps = {m: [] for m in MODES}
    stats = {m: [] for m in MODES[1:]}
    same = {m: [] for m in MODES[1:]}
    for i, line in enumerate(lines):
        ids = encode_line(tok, line)
        out = {}
        for mode in MODES[i % 3 :] + MODES[: i % 3]:
            if mode == "plain":
                out[mode] = collect(generate_autoregressive(target.runner, ids, base, tok))
            else:
                out[mode] = collect(generate_speculative(target.runner, drafter, ids, settings[mode], tok))
            tps[mode].append(out[mode][1].decode_tps)
        for mode in MODES[1:]:
            stats[mode].append(out[mode][1])
            same[mode].append(out[mode][0] == out["plain"][0])
        print(
            f"  prompt {i + 1}/{len(lines)}: "
            + ", ".join(f"{m} {tps[m][-1]:.1f}" for m in MODES)
            + f" tok/s; copy accepted {out['default'][1].by_source['copy']['accepted']}",
            file=sys.stderr,
        )
    mean = {m: statistics.fmean(v) for m, v in tps.items()}
    cell = {"decode_tps": mean, "identical": {m: sum(v) for m, v in same.items()}, "prompts": len(lines)}
    cell["speedup"] = {m: mean[m] / mean["plain"] for m in MODES[1:]}
    cell["default_over_drafter"] = mean["default"] / mean["drafter"]
    for mode in MODES[1:]:
        runs = stats[mode]
        cycles = sum(s.verify_steps for s in runs)
        by_source = {}
        for s in runs:
            for source, counts in s.by_source.items():
                total = by_source.setdefault(source, dict.fromkeys(counts, 0))
                for k, n in counts.items():
                    total[k] += n
        controller = merge_controller([s.controller for s in runs])
        cell[mode] = {
            "acceptance_length": sum(s.cycle_tokens for s in runs) / cycles if cycles else 1.0,
            "by_source": by_source,
            "controller": controller,
            "flat_curve_speedup": flat_curve_speedup(controller),
        }
    return cell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft-model", default=None, help="default: the model's shipped drafter")
    ap.add_argument("--sets", default="edit,long,agent,chat")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from dflash2_mlx.models.named import shipped_drafter

    target = load_target(args.model)
    drafter = load_drafter(str(args.draft_model or shipped_drafter(args.model)))
    results = {}
    for name in args.sets.split(","):
        lines = read_prompts(PROMPTS / f"{name}.jsonl")[: args.limit]
        for temperature in (float(t) for t in args.temps.split(",")):
            print(f"{name}, T={temperature:g}:", file=sys.stderr)
            cell = run_cell(target, drafter, lines, temperature, args.max_tokens, args.seed)
            results[f"{name}/T={temperature:g}"] = cell
            d, a = cell["default"], cell["drafter"]
            print(
                f"{name:6} T={temperature:<4g} default {cell['speedup']['default']:.2f}x plain, "
                f"{cell['default_over_drafter']:.2f}x the drafter alone ({cell['speedup']['drafter']:.2f}x plain); "
                f"acceptance {d['acceptance_length']:.2f} (drafter alone {a['acceptance_length']:.2f}); "
                f"copy {d['by_source']['copy']['accepted']}/{d['by_source']['copy']['drafted']}, "
                f"dflash {d['by_source']['dflash']['accepted']}/{d['by_source']['dflash']['drafted']}; "
                f"identical {cell['identical']['default']}/{cell['prompts']}; "
                f"flat verify curve: {d['flat_curve_speedup']:.2f}x (drafter alone {a['flat_curve_speedup']:.2f}x)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
