"""Issue 41's check on SmolLM2: a seeded request repeats, through `generate` and through a server.

    python benchmarks/seeded_repeat.py
    python benchmarks/seeded_repeat.py --model smollm2 --temp 0.7 --top-p 0.9 --seed 1234 --times 5

The same chat request (T, top-p and seed given) is sent ``--times`` times through
``dflash2-mlx generate`` (a new process each time, the default speculative mode), then through a
real ``dflash2-mlx serve`` process with the openai SDK: ``--times`` times alone, then ``--times``
times at once beside unseeded requests for other prompts. Prints a digest of every answer; exit
status 1 unless every run, through either path, gave the same text.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_helpers import running_server  # noqa: E402

PROMPT = "Write a short email to my manager asking for a day off next Friday."
OTHERS = ("Give me some advice on sleeping better.", "Plan a 3-day trip to Rome for me.", "What is 17 times 23?")


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--times", type=int, default=5)
    args = ap.parse_args()
    sampling = ["--temp", str(args.temp), "--top-p", str(args.top_p), "--max-tokens", str(args.max_tokens)]

    generated = [
        subprocess.run(
            [sys.executable, "-m", "dflash2_mlx", "generate", "-m", args.model, "--prompt", PROMPT,
             "--seed", str(args.seed), *sampling],
            capture_output=True, text=True, check=True,
        ).stdout.removesuffix("\n")  # generate ends its text with a newline
        for _ in range(args.times)
    ]  # fmt: skip
    print(f"generate x{args.times}:", [digest(t) for t in generated])

    import openai

    with tempfile.TemporaryDirectory() as tmp, running_server(["--model", args.model], Path(tmp) / "serve.log") as s:
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused")

        def ask(prompt: str = PROMPT, seed=args.seed) -> str:
            reply = client.chat.completions.create(
                model=args.model,
                messages=[{"role": "user", "content": prompt}],
                temperature=args.temp,
                top_p=args.top_p,
                seed=seed,
                max_tokens=args.max_tokens,
            )
            return reply.choices[0].message.content

        alone = [ask() for _ in range(args.times)]
        with concurrent.futures.ThreadPoolExecutor(args.times + 2 * len(OTHERS)) as pool:
            seeded = [pool.submit(ask) for _ in range(args.times)]
            for other in OTHERS * 2:
                pool.submit(ask, other, None)
            beside = [f.result() for f in seeded]
    print(f"server x{args.times} alone:", [digest(t) for t in alone])
    print(f"server x{args.times} beside {2 * len(OTHERS)} other requests:", [digest(t) for t in beside])
    print("answer:", alone[0][:200].replace("\n", " "))
    same = len(set(generated + alone + beside)) == 1
    print("every run, through generate and the server, the same text:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
