"""Load test of `dflash2-mlx serve` on loopback: concurrent streaming clients, checked for exactness.

Starts a server process, runs every prompt once alone (greedy, streaming) as the reference, then
runs CLIENTS concurrent streaming clients with REQUESTS requests each (the same prompts) and checks
every concurrent output is identical to its solo run. Reports time to first token (p50/p95, from
sending the request to the first content chunk: queue wait included), per-request latency and
total throughput (completion tokens / wall time) for the solo and concurrent phases.

    python benchmarks/server_load.py [--model M --draft-model D] [--clients 16] [--requests 4]
                                     [--max-tokens 64] [--time-limit 600] [--json]

Without --model it uses the embedded demo pair when installed, else builds the tests' tiny pair
(tests/tiny.py) in a temporary directory. Loopback only; the run is bounded by --time-limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_helpers import metrics, running_server  # noqa: E402

from dflash2_mlx.server.app import model_name_for  # noqa: E402

PROMPT_TOPICS = ["sorting a list", "a binary tree", "reading a file", "parsing JSON", "a web request",
                 "a prime sieve", "string reversal", "a linked list", "matrix product", "a stack",
                 "a queue", "memoization", "a retry loop", "a CSV writer", "date parsing", "a regex"]


def models(args, tmp: Path) -> tuple[str, str | None]:
    if args.model:
        return args.model, args.draft_model
    try:
        from dflash2_mlx import assets

        target, drafter = Path(assets.demo_target_path()), Path(assets.demo_drafter_path())
        if (target / "config.json").exists() and (drafter / "config.json").exists():
            return str(target), str(drafter)
    except (ImportError, AttributeError, OSError):
        pass
    import tiny  # tests/tiny.py

    cfg = tiny.hybrid_config()
    target = tiny.save_target(tiny.build_target(cfg, seed=0, scale=3.0), cfg, tmp / "target")
    drafter = tiny.save_drafter(tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8)), tmp / "drafter")
    return str(target), str(drafter)


async def stream_one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, finish = None, [], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
                finish = choice.get("finish_reason") or finish
    total = time.perf_counter() - t0
    return {"prompt": prompt, "text": "".join(text), "ttft": ttft if ttft is not None else total, "latency": total,
            "tokens": usage["completion_tokens"] if usage else 0, "finish_reason": finish}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summary(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    lat = [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "wall_s": round(wall, 3), "completion_tokens": tokens,
            "throughput_tok_s": round(tokens / wall, 1) if wall else 0.0,
            "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p95_s": round(pct(ttft, 0.95), 4),
            "latency_p50_s": round(statistics.median(lat), 4), "latency_p95_s": round(pct(lat, 0.95), 4)}


async def run(base: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
              deadline: float) -> dict:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0), limits=limits) as client:
        await stream_one(client, model, "warm up", 8)
        solo, t0 = {}, time.perf_counter()
        for p in prompts:
            if time.perf_counter() > deadline:
                raise TimeoutError("time limit reached during the solo runs")
            solo[p] = await stream_one(client, model, p, max_tokens)
        solo_wall = time.perf_counter() - t0

        async def client_task(c: int) -> list[dict]:
            out = []
            for k in range(requests):
                out.append(await stream_one(client, model, prompts[(c * requests + k) % len(prompts)], max_tokens))
            return out

        t0 = time.perf_counter()
        remaining = max(1.0, deadline - time.perf_counter())
        per_client = await asyncio.wait_for(asyncio.gather(*(client_task(c) for c in range(clients))), remaining)
        wall = time.perf_counter() - t0
    results = [r for rs in per_client for r in rs]
    mismatches = [r["prompt"] for r in results if r["text"] != solo[r["prompt"]]["text"]]
    return {"solo": summary(list(solo.values()), solo_wall), "concurrent": summary(results, wall),
            "identical_to_solo": not mismatches, "mismatches": mismatches[:5]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    deadline = time.perf_counter() + args.time_limit
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = models(args, Path(tmp))
        serve_args = ["--model", target] + (["--draft-model", drafter] if drafter else ["--no-draft"])
        serve_args += ["--max-queue", str(args.clients * 2), "--request-timeout", str(args.time_limit)]
        n = args.clients * args.requests
        prompts = [f"Write Python code for {PROMPT_TOPICS[i % len(PROMPT_TOPICS)]} (variant {i})." for i in range(n)]
        with running_server(serve_args, Path(tmp) / "server.log", nice=False) as srv:
            report = asyncio.run(run(srv.base, model_name_for(target), prompts, args.clients,
                                     args.requests, args.max_tokens, deadline))
            m = metrics(srv.base)
            report["server"] = {"acceptance_length": m.get("dflash2_mlx_acceptance_length"),
                                "queue_depth_after": m.get("dflash2_mlx_queue_depth"),
                                "prefix_cache_hits": m.get("dflash2_mlx_prefix_cache_hits_total")}
            report["setup"] = {"model": target, "drafter": drafter, "clients": args.clients,
                               "requests_per_client": args.requests, "max_tokens": args.max_tokens}
            if "Traceback" in srv.log_text():
                report["server_errors"] = srv.log_text()[-2000:]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        s, c = report["solo"], report["concurrent"]
        print(f"solo:       {s['requests']} requests in {s['wall_s']:.1f} s, {s['throughput_tok_s']} tok/s, "
              f"TTFT p50 {s['ttft_p50_s'] * 1000:.0f} ms p95 {s['ttft_p95_s'] * 1000:.0f} ms")
        print(f"concurrent: {args.clients} clients x {args.requests} = {c['requests']} requests in {c['wall_s']:.1f} s, "
              f"{c['throughput_tok_s']} tok/s, TTFT p50 {c['ttft_p50_s'] * 1000:.0f} ms p95 {c['ttft_p95_s'] * 1000:.0f} ms, "
              f"latency p50 {c['latency_p50_s']:.2f} s p95 {c['latency_p95_s']:.2f} s")
        print(f"outputs identical to solo runs: {report['identical_to_solo']}; "
              f"acceptance length {report['server']['acceptance_length']}")
    return 0 if report["identical_to_solo"] and "server_errors" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
