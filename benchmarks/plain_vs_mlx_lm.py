"""Our plain decoding against mlx-lm's, on the same target and weights, in one process.

    python benchmarks/plain_vs_mlx_lm.py [--model smollm2] [--max-tokens 64] [--rounds 5] [--json out.json]

``generate_autoregressive`` (the project's runner, greedy) and ``mlx_lm.stream_generate`` (mlx-lm's
own model call, greedy) run the same chat prompts on the same loaded model object, interleaved
(order alternating per round), so that contention from other processes hits both alike. Decode
speed for both is (tokens - 1) / (time from the first token to the last), the project's
``decode_tps``; the ratio reported is the median over runs of the same round's ours / mlx-lm. The
greedy outputs are compared too (float32 on a CPU: they should be identical); both stop at the
end-of-sequence token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import dflash2_mlx  # noqa: F401  (the optimised BLAS before mlx.core)

# isort: split

# Requests with long answers: a short one ("What is the capital of France?") ends after ~8 tokens,
# too few to time decoding.
PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
]


def decode_tps(token_times: list[float]) -> float:
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="target (default: smollm2)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from mlx_lm.generate import stream_generate

    from dflash2_mlx.engine import GenerationSettings, generate_autoregressive
    from dflash2_mlx.models.loading import load_target

    target = load_target(args.model)
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]

    def ours(ids):
        times, tokens = [], []
        # stop where mlx-lm's stream_generate stops: at the tokenizer's end-of-sequence tokens
        settings = GenerationSettings(max_tokens=args.max_tokens, stop_token_ids=sorted(tok.eos_token_ids))
        for event in generate_autoregressive(target.runner, ids, settings):
            times += [time.perf_counter()] * len(event.tokens)
            tokens += event.tokens
        return tokens, times

    def theirs(ids):
        times, tokens = [], []
        for response in stream_generate(target.runner.model, tok, ids, max_tokens=args.max_tokens):
            times.append(time.perf_counter())
            tokens.append(response.token)
        return tokens, times

    ours(prompts[0])  # warm-up both (compiled shapes, first-call costs)
    theirs(prompts[0])
    cells = []
    for r in range(args.rounds):
        for i, ids in enumerate(prompts):
            runs = {}
            for name in ("ours", "mlx-lm") if (r + i) % 2 == 0 else ("mlx-lm", "ours"):
                runs[name] = (ours if name == "ours" else theirs)(ids)
            ours_tps, their_tps = decode_tps(runs["ours"][1]), decode_tps(runs["mlx-lm"][1])
            cells.append(
                {
                    "round": r,
                    "prompt": i,
                    "ours_tps": ours_tps,
                    "mlx_lm_tps": their_tps,
                    "ratio": ours_tps / their_tps,
                    "identical": runs["ours"][0] == runs["mlx-lm"][0],
                }
            )
    ratios = [c["ratio"] for c in cells]
    summary = {
        "model": target.name,
        "ours_tps_median": statistics.median(c["ours_tps"] for c in cells),
        "mlx_lm_tps_median": statistics.median(c["mlx_lm_tps"] for c in cells),
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "identical_outputs": all(c["identical"] for c in cells),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"json": str(args.json)}, "summary": summary, "cells": cells}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
