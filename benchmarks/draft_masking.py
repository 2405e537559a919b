"""Does masking the drafter's candidates with the grammar pay? Acceptance and decode tok/s.

    python benchmarks/draft_masking.py [--prompts 6] [--max-tokens 96] [--block-size 8]
        [--temperature 0.7 [--top-p 0.9] --seeds 3] [--json out.json]

On the embedded pair with a JSON schema, same prompts (and seeds), interleaved, three settings of
``GenerationSettings.mask_drafts``:

- ``masked-drafts`` (True): every block's k selector candidates per row are filtered by the
  matcher advanced along the path so far, and the best allowed one by pair score is kept
  (``GrammarState.greedy_path``; sampled, on the scores noised with the request's keyed draws);
- ``verify-masks-only`` (False): the kernel's walk, drafts the grammar refuses are proposed and
  rejected;
- ``auto`` (None, the default): the walk while refused drafts often end the accepted run
  (``GrammarState.walk_pays``).

The walk needs the committed tokens, so it runs on the host between the previous cycle's sync and
the verify pass (the device part of the block is drafted ahead either way). Greedy output must be
identical (the verify masks decide, drafts only change acceptance); sampled output follows the
same distribution but not the same draws, so every answer is checked against the schema instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split

sys.path.insert(0, str(Path(__file__).parent))
from constrained_decode import SCHEMA  # noqa: E402
from harness import load_pair, write_report  # noqa: E402

MODES = {"auto": None, "masked-drafts": True, "verify-masks-only": False}  # mode -> GenerationSettings.mask_drafts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=None, help="pin the block size (default: the controller)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=1, help="runs per prompt and mode, seeds 0..n-1 (sampling)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import jsonschema

    from dflash2_mlx import assets
    from dflash2_mlx.constraints.grammar import Grammar
    from dflash2_mlx.decoding.output import collect
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings

    target, drafter = load_pair()
    tok, runner = target.tokenizer, target.runner
    stops = sorted(tok.eos_token_ids)
    grammar = Grammar.json_schema(SCHEMA, tok, stops)
    sampling = SamplingSettings(temperature=args.temperature, top_p=args.top_p)
    greedy = sampling.greedy
    out = {m: {"tps": [], "cycles": 0, "cycle_tokens": 0, "valid": 0, "runs": 0} for m in MODES}
    identical = True
    for i, prompt in enumerate(assets.demo_prompts()[: args.prompts]):
        ids = tok.encode(prompt, add_special_tokens=False)
        for seed in range(1 if greedy else args.seeds):
            runs = {}
            for rep in range(2 if i == 0 and seed == 0 else 1):
                for mode, mask_drafts in MODES.items():
                    settings = GenerationSettings(
                        max_tokens=args.max_tokens,
                        stop_token_ids=stops,
                        grammar=grammar,
                        sampling=sampling,
                        seed=seed,
                        block_size=args.block_size,
                        mask_drafts=mask_drafts,
                    )
                    tokens, stats = collect(generate_speculative(runner, drafter, ids, settings))
                    runs[mode] = tokens
                    if i == 0 and seed == 0 and rep == 0:
                        continue  # warm-up
                    r = out[mode]
                    r["tps"].append(stats.decode_tps)
                    r["cycles"] += stats.verify_steps
                    r["cycle_tokens"] += stats.cycle_tokens
                    r["runs"] += 1
                    if stats.finish_reason == "stop":  # a complete answer (else cut at max_tokens)
                        text = tok.decode([t for t in tokens if t not in stops])
                        jsonschema.validate(json.loads(text), SCHEMA)
                        r["valid"] += 1
            identical &= runs["auto"] == runs["masked-drafts"] == runs["verify-masks-only"]
    report = {
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seeds": 1 if greedy else args.seeds,
    }
    if greedy:
        report["identical"] = identical
    for mode, r in out.items():
        report[mode] = {
            "decode_tps_mean": statistics.mean(r["tps"]),
            "acceptance_length": r["cycle_tokens"] / r["cycles"],
            "complete_valid_answers": f"{r['valid']}/{r['runs']}",
        }
    never = report["verify-masks-only"]["decode_tps_mean"]
    report["speedup"] = report["masked-drafts"]["decode_tps_mean"] / never
    report["auto_speedup"] = report["auto"]["decode_tps_mean"] / never
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
