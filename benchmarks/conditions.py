"""Where does speculation pay? One table over pair x temperature x prompt x mode.

    python benchmarks/conditions.py [--draft-model D [--model M] [--prompts F]] [--limit 4] [--max-tokens 96]
                                    [--long 3000] [--temps 0,0.7,1.0] [--repeats 3] [--modes 2,4,8,auto]
                                    [--json out.json]

- pair: the embedded pair, plus the pair given by --model / --draft-model (--draft-model alone:
  the embedded target with that drafter, e.g. a weaker one from `dflash2-mlx train-drafter`);
- temperature: 0, 0.7, 1.0;
- prompt: the pair's prompt set (the embedded pair's own, first --limit) and one held-out
  standard-library text of about --long tokens, fed as is (--limit 0: only that one);
- mode: plain decoding, the fixed loop at block 2 / 4 / 8, and auto (the break-even controller);
  --modes keeps some of them (plain always runs: every ratio is to it), e.g. to measure one
  cell longer.

Per cell: decode tok/s, acceptance length (cycle tokens / speculative cycles) and speedup over
plain decoding, measured in the same run. After an untimed warm-up of every mode (which also
calibrates the controller and gives it the pair's history at that temperature, as any earlier
request would), ``--repeats`` rounds run every mode on every prompt, in an order that rotates
from prompt to prompt, each mode right next to a plain-decoding run of its own (before it or
after it, alternating). A round's speedup is the mode's decode tok/s over its own plain runs'
in that round (tok/s: the round's tokens over its decode seconds); the cell reports the median
over the rounds, and its spread (lowest, highest). Pairing each mode with the plain run beside
it, rather than with one plain run per prompt, keeps a slow spell or what the previous run left
in memory from landing on one mode only. On a shared machine one run of a second or two can
be 30% off in either direction; pairing each mode with the plain runs of its own round and taking
the median is what makes a 3% bar measurable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split

MODES = ("plain", "2", "4", "8", "auto")


def run_mode(target, drafter, ids, mode: str, temperature: float, max_tokens: int, seed: int):
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.output import collect
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings

    settings = GenerationSettings(
        max_tokens=max_tokens,
        sampling=SamplingSettings(temperature=temperature),
        seed=seed,
        block_size=None if mode in ("plain", "auto") else int(mode),
    )
    if mode == "plain":
        return collect(generate_autoregressive(target.runner, ids, settings))[1]
    return collect(generate_speculative(target.runner, drafter, ids, settings))[1]


def cell_rows(
    target, drafter, prompts: list[list[int]], temperature: float, max_tokens: int, repeats: int = 3, wanted=MODES
) -> dict:
    """Every mode on every prompt, ``repeats`` rounds, interleaved -> per mode: tok/s, acceptance,
    speedup (median over rounds of the same round's ratio to plain) and its spread, controller."""
    import statistics

    from dflash2_mlx.diagnostics.bench import merge_controller

    fits = [m for m in MODES if m == "plain" or m == "auto" or int(m) <= drafter.config.block_size]
    modes = [m for m in fits if m == "plain" or m in wanted]
    for mode in modes:  # warm-up
        run_mode(target, drafter, prompts[0], mode, temperature, min(max_tokens, 32), 0)
    others = [m for m in modes if m != "plain"]
    # mode -> round -> stats per prompt; paired: mode -> round -> the plain runs beside them
    runs = {m: [[] for _ in range(repeats)] for m in others}
    paired = {m: [[] for _ in range(repeats)] for m in others}
    turn = 0
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            order = others[turn % len(others) :] + others[: turn % len(others)]
            turn += 1
            for mode in order:  # each mode right next to a plain run of its own, before or after it
                pair = (mode, "plain") if (r + i) % 2 else ("plain", mode)
                for m in pair:
                    stats = run_mode(target, drafter, ids, m, temperature, max_tokens, seed=i)
                    (paired if m == "plain" else runs)[mode][r].append(stats)

    def tps(stats) -> float:  # a round's decode tokens over its decode seconds
        seconds = sum(s.decode_seconds for s in stats)
        return sum(max(s.generation_tokens - 1, 0) for s in stats) / seconds if seconds else 0.0

    all_plain = [[s for m in others for s in paired[m][r]] for r in range(repeats)]
    out = {
        "plain": {
            "decode_tps": statistics.median(tps(rnd) for rnd in all_plain),
            "acceptance_length": 1.0,
            "speedup": 1.0,
            "speedup_range": [1.0, 1.0],
            "controller": None,
        }
    }
    for mode, rounds in runs.items():
        ratios = [tps(rnd) / tps(p) if tps(p) else 0.0 for rnd, p in zip(rounds, paired[mode])]
        flat = [s for rnd in rounds for s in rnd]
        cycles = sum(s.verify_steps for s in flat)
        out[mode] = {
            "decode_tps": statistics.median(tps(rnd) for rnd in rounds),
            "acceptance_length": sum(s.cycle_tokens for s in flat) / cycles if cycles else 1.0,
            "speedup": statistics.median(ratios),
            "speedup_range": [min(ratios), max(ratios)],
            "controller": merge_controller([s.controller for s in flat]) if mode == "auto" else None,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target of the extra pair (default: the embedded target)")
    ap.add_argument("--draft-model", help="drafter of the extra pair")
    ap.add_argument("--limit", type=int, default=4, help="prompts of the prompt set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--long", type=int, default=3000, help="tokens of the long prompt")
    ap.add_argument("--temps", default="0,0.7,1.0")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every mode on every prompt (median)")
    ap.add_argument("--modes", default=",".join(MODES[1:]), help="modes besides plain decoding")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip-embedded", action="store_true", help="only the --draft-model pair")
    ap.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="the --draft-model pair's prompt set (bench's JSON lines; default: the embedded pair's prompts)",
    )
    args = ap.parse_args(argv)
    wanted = args.modes.split(",")
    if unknown := set(wanted) - set(MODES[1:]):
        ap.error(f"unknown modes {sorted(unknown)}: choose among {', '.join(MODES[1:])}")

    sys.path.insert(0, str(Path(__file__).parent))
    from long_context import held_out_tokens

    from dflash2_mlx.cli.common import embedded_pair, embedded_prompts, encode_line
    from dflash2_mlx.diagnostics.bench import read_prompts
    from dflash2_mlx.models.loading import load_drafter, load_target

    embedded = embedded_pair()
    pairs = [] if args.skip_embedded else [("embedded", str(embedded[0]), str(embedded[1]), embedded_prompts())]
    if args.draft_model:
        pairs.append(
            (
                f"{Path(args.model or 'embedded target').name} + {Path(args.draft_model).name}",
                args.model or str(embedded[0]),
                args.draft_model,
                read_prompts(args.prompts) if args.prompts else embedded_prompts(),
            )
        )
    temps = [float(t) for t in args.temps.split(",")]
    paths = {k: str(v) if v is not None else None for k, v in vars(args).items() if k in ("json", "prompts")}
    report = {"settings": vars(args) | paths, "cells": []}
    for name, target_path, drafter_path, lines in pairs:
        target, drafter = load_target(target_path), load_drafter(drafter_path)
        tok = target.tokenizer
        prompt_sets = {
            f"prompt set ({args.limit})": [encode_line(tok, line) for line in lines[: args.limit]],
            f"long ({args.long} tokens)": [held_out_tokens(tok, args.long)],
        }
        prompt_sets = {name: prompts for name, prompts in prompt_sets.items() if prompts}
        for temperature in temps:
            for prompt_name, prompts in prompt_sets.items():
                rows = cell_rows(target, drafter, prompts, temperature, args.max_tokens, args.repeats, wanted)
                cell = {"pair": name, "temperature": temperature, "prompt": prompt_name, "modes": rows}
                report["cells"].append(cell)
                print(_line(cell), flush=True)
                if args.json:  # after every cell: a long run interrupted keeps what it measured
                    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print()
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _line(cell: dict) -> str:
    modes = "  ".join(f"{m} {r['decode_tps']:.0f} tok/s {r['speedup']:.2f}x" for m, r in cell["modes"].items())
    return f"{cell['pair']} T={cell['temperature']:g} {cell['prompt']}: {modes}"


def markdown(report: dict) -> str:
    """The table: one row per (pair, temperature, prompt); per mode speedup (acceptance)."""
    head = ["pair", "T", "prompt", "plain tok/s"] + [f"{m}" for m in MODES[1:]] + ["auto / best fixed", "auto chose"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in report["cells"]:
        rows = cell["modes"]
        fixed = [rows[m]["speedup"] for m in MODES[1:-1] if m in rows]
        best = max(fixed, default=0.0)
        cells = [cell["pair"], f"{cell['temperature']:g}", cell["prompt"], f"{rows['plain']['decode_tps']:.0f}"]
        cells += [
            f"{rows[m]['speedup']:.2f}x ({rows[m]['acceptance_length']:.2f})" if m in rows else "–" for m in MODES[1:]
        ]
        if "auto" not in rows:
            cells += ["–", "–"]
        else:
            auto = rows["auto"]["speedup"]
            lo, hi = rows["auto"].get("speedup_range", (auto, auto))
            cells[-1] += f" [{lo:.2f}–{hi:.2f}]"
            c = rows["auto"]["controller"] or {}
            share = c.get("share_by_mode", {})
            chose = (
                f"{100 * share.get('speculative', 0):.0f}% spec / {100 * share.get('plain', 0):.0f}% plain / "
                f"{100 * share.get('probe', 0):.0f}% probe; blocks "
                + " ".join(f"{b}:{n}" for b, n in c.get("block_sizes", {}).items())
            )
            cells += [f"{auto / best:.2f} of best" if best > 1 else f"{auto:.2f}x plain", chose]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
