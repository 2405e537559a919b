"""The same greedy request through /v1/chat/completions and /v1/responses, interleaved in one run
against one real server on the embedded pair: identical tokens and speculation statistics, and the
ratio of median wall times (what the Responses translation and output shaping cost on top).

    python benchmarks/responses_vs_chat.py [--pairs 16] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

NEVER_STOP = {"0": -100, "2": -100}  # the pair's end tokens banned: every answer has max-tokens tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    import openai
    from server_helpers import running_server

    from dflash2_mlx import assets

    log = Path(tempfile.mkdtemp()) / "server.log"
    serve = ["--model", str(assets.demo_target_path()), "--draft-model", str(assets.demo_drafter_path())]
    with running_server(serve, log, nice=False) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        model, times = "tiny-code-demo-target", {"chat": [], "responses": []}
        for _ in range(args.pairs + 1):  # the first pair warms up
            t = time.perf_counter()
            chat = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "def fib(n):"}],
                max_tokens=args.max_tokens,
                temperature=0,
                logit_bias=NEVER_STOP,
            )
            times["chat"].append(time.perf_counter() - t)
            t = time.perf_counter()
            resp = client.responses.create(
                model=model,
                input="def fib(n):",
                max_output_tokens=args.max_tokens,
                temperature=0,
                extra_body={"logit_bias": NEVER_STOP},
            )
            times["responses"].append(time.perf_counter() - t)
            assert chat.choices[0].message.content == resp.output_text
            assert chat.model_extra["speculative"] == resp.model_extra["speculative"]
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        print(
            f"{args.pairs} interleaved pairs, {args.max_tokens} tokens each, identical outputs and statistics "
            f"(acceptance {resp.model_extra['speculative']['acceptance_length']})"
        )
        print(
            f"median wall time: chat {1000 * med['chat']:.1f} ms, responses {1000 * med['responses']:.1f} ms, "
            f"responses / chat {med['responses'] / med['chat']:.3f}"
        )


if __name__ == "__main__":
    main()
