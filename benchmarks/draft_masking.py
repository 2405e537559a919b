"""Does masking the drafter's candidates with the grammar pay? Acceptance and decode tok/s.

    python benchmarks/draft_masking.py [--prompts 6] [--max-tokens 96] [--json out.json]

On the embedded pair with a JSON schema, greedy, same prompts, interleaved: the engine as it runs
(``masked-drafts``: each row's k selector candidates filtered by the matcher advanced along the
path so far, the best allowed one by pair score kept, ``GrammarState.greedy_path``) vs the same
loop with the plain greedy walk over the same pair scores (``verify-masks-only``: drafts the
grammar refuses are proposed and rejected). Both draft each block after the previous cycle's host
sync (the masked walk needs the committed tokens). Output must be identical: the verify masks
decide, drafts only change acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

sys.path.insert(0, str(Path(__file__).parent))
from constrained_decode import SCHEMA  # noqa: E402


class UnmaskedWalk:
    """The grammar, but its states walk the selector's candidates without skipping refused ones."""

    def __init__(self, grammar):
        self.grammar = grammar

    def start(self):
        import numpy as np

        state = self.grammar.start()

        def plain_walk(candidates, pairs):
            candidates, pairs = np.asarray(candidates), np.asarray(pairs)
            path, prev = [], 0
            for i in range(candidates.shape[0]):
                prev = int(np.argmax(pairs[i, prev]))  # the first maximum, as the selector's walk
                path.append(int(candidates[i, prev]))
            return path

        state.greedy_path = plain_walk
        return state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from dflash2_mlx import assets
    from dflash2_mlx.constrained import Grammar
    from dflash2_mlx.engine import GenerationSettings, collect, generate_speculative
    from dflash2_mlx.loading import load_drafter, load_target

    target = load_target(str(assets.demo_target_path()))
    drafter = load_drafter(str(assets.demo_drafter_path()))
    tok, runner = target.tokenizer, target.runner
    stops = sorted(tok.eos_token_ids)
    grammar = Grammar.json_schema(SCHEMA, tok, stops)
    modes = {"masked-drafts": grammar, "verify-masks-only": UnmaskedWalk(grammar)}
    out = {m: {"tps": [], "cycles": 0, "cycle_tokens": 0} for m in modes}
    identical = True
    for i, prompt in enumerate(assets.demo_prompts()[: args.prompts]):
        ids = tok.encode(prompt, add_special_tokens=False)
        runs = {}
        for rep in range(2 if i == 0 else 1):
            for mode, g in modes.items():
                settings = GenerationSettings(max_tokens=args.max_tokens, stop_token_ids=stops, grammar=g)
                tokens, stats = collect(generate_speculative(runner, drafter, ids, settings))
                runs[mode] = tokens
                if i == 0 and rep == 0:
                    continue  # warm-up
                out[mode]["tps"].append(stats.decode_tps)
                out[mode]["cycles"] += stats.verify_steps
                out[mode]["cycle_tokens"] += stats.cycle_tokens
        identical &= runs["masked-drafts"] == runs["verify-masks-only"]
    report = {"prompts": args.prompts, "max_tokens": args.max_tokens, "identical": identical}
    for mode, r in out.items():
        report[mode] = {"decode_tps_mean": statistics.mean(r["tps"]), "acceptance_length": r["cycle_tokens"] / r["cycles"]}
    report["speedup"] = report["masked-drafts"]["decode_tps_mean"] / report["verify-masks-only"]["decode_tps_mean"]
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
