"""Load test of `dflash2-mlx serve` on loopback: concurrent streaming clients, checked for exactness.

Starts one server process per ``--max-concurrent`` value (default 1 and 4: one request at a time,
as before the scheduler, against interleaved decoding), runs every prompt once alone on the first
(greedy, streaming) as the reference, then runs CLIENTS concurrent streaming clients with REQUESTS
requests each (the same prompts), the servers taking turns for ``--repeats`` rounds, and checks
every concurrent output is identical to its solo run. Reports time to first token (p50/p95, from
sending the request to the first content chunk: queue wait included), per-request latency and
total throughput (completion tokens / wall time) for the solo and concurrent phases. Then, on each
server, a 16-token request is sent while a 1500-token stream runs: its latency against its solo
latency, and whether the long stream's text stayed the same. First, on a server with default
settings (disk prompt cache on), ``--stall-trials`` 16-token requests are timed one after another
during 1500-token streams: their p99 and maximum latency against their solo median (the bar:
p99 <= 3x solo + 0.5 s, max <= 2 s; ``--stall-only`` runs just that).

    python benchmarks/server_load.py [--model M --draft-model D] [--clients 16] [--requests 4]
                                     [--max-tokens 64] [--max-concurrent 1 4] [--repeats 1]
                                     [--stall-trials 50] [--stall-only] [--time-limit 900] [--json]

Without --model it uses the embedded demo pair when installed, else builds the tests' tiny pair
(tests/tiny.py) in a temporary directory. Loopback only; the run is bounded by --time-limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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

PROMPT_TOPICS = [
    "sorting a list",
    "a binary tree",
    "reading a file",
    "parsing JSON",
    "a web request",
    "a prime sieve",
    "string reversal",
    "a linked list",
    "matrix product",
    "a stack",
    "a queue",
    "memoization",
    "a retry loop",
    "a CSV writer",
    "date parsing",
    "a regex",
]


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


async def stream_one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, **extra) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
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
    return {
        "prompt": prompt,
        "text": "".join(text),
        "ttft": ttft if ttft is not None else total,
        "latency": total,
        "tokens": usage["completion_tokens"] if usage else 0,
        "finish_reason": finish,
    }


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summary(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    lat = [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 1) if wall else 0.0,
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p95_s": round(pct(ttft, 0.95), 4),
        "latency_p50_s": round(statistics.median(lat), 4),
        "latency_p95_s": round(pct(lat, 0.95), 4),
    }


async def solo_runs(base: str, model: str, prompts: list[str], max_tokens: int, deadline: float) -> tuple[dict, float]:
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0)) as client:
        await stream_one(client, model, "warm up", 8)
        solo, t0 = {}, time.perf_counter()
        for p in prompts:
            if time.perf_counter() > deadline:
                raise TimeoutError("time limit reached during the solo runs")
            solo[p] = await stream_one(client, model, p, max_tokens)
    return solo, time.perf_counter() - t0


async def concurrent_runs(
    base: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int, deadline: float
) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def client_task(c: int) -> list[dict]:
            out = []
            for k in range(requests):
                out.append(await stream_one(client, model, prompts[(c * requests + k) % len(prompts)], max_tokens))
            return out

        t0 = time.perf_counter()
        remaining = max(1.0, deadline - time.perf_counter())
        per_client = await asyncio.wait_for(asyncio.gather(*(client_task(c) for c in range(clients))), remaining)
    return [r for rs in per_client for r in rs], time.perf_counter() - t0


async def short_beside_long(base: str, model: str, no_eos: dict, long_tokens: int = 1500) -> dict:
    """A 16-token request sent while a ``long_tokens``-token stream runs (lengths fixed by a logit
    bias against the end tokens): its latency against its solo latency (median of 3)."""
    short, long_ = "Write a Python function that adds two numbers.", "Write a long Python module for a parser."
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0)) as client:
        await stream_one(client, model, short, 16, logit_bias=no_eos)
        solo = []
        for _ in range(3):
            r = await stream_one(client, model, short, 16, logit_bias=no_eos)
            solo.append(r["latency"])
        long_solo = await stream_one(client, model, long_, long_tokens, logit_bias=no_eos)
        long_task = asyncio.create_task(stream_one(client, model, long_, long_tokens, logit_bias=no_eos))
        await asyncio.sleep(min(2.0, long_solo["latency"] / 4))
        beside = await stream_one(client, model, short, 16, logit_bias=no_eos)
        still_running = not long_task.done()
        long_beside = await long_task
    return {
        "short_solo_latency_s": round(statistics.median(solo), 4),
        "short_beside_latency_s": round(beside["latency"], 4),
        "short_beside_ttft_s": round(beside["ttft"], 4),
        "long_stream_still_running": still_running,
        "long_stream_s": round(long_solo["latency"], 3),
        "long_tokens": long_beside["tokens"],
        "long_text_unchanged": long_beside["text"] == long_solo["text"],
        "short_text_unchanged": beside["text"] == r["text"],
        "within_3x_plus_0.5s": beside["latency"] <= 3 * statistics.median(solo) + 0.5,
    }


async def shorts_during_long_streams(
    base: str, model: str, no_eos: dict, trials: int, long_tokens: int = 1500, deadline: float = float("inf")
) -> dict:
    """Short requests (16 tokens, alternately greedy and sampled at temperature 0.7: the first
    sampled one used to trigger a calibration) sent one after another while 1500-token greedy
    streams run (a new stream starts when one ends): the p99 and maximum of their latencies over
    ``trials``, against the median of the same requests sent alone."""
    short, long_ = "Write a Python function that adds two numbers.", "Write a long Python module for a parser."
    temperatures = [0.0, 0.7]
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0)) as client:
        solo = []
        for i in range(10):
            r = await stream_one(client, model, short, 16, logit_bias=no_eos, temperature=temperatures[i % 2])
            solo.append(r["latency"])
        solo = solo[2:]  # the first of each kind warms up
        beside: list[float] = []
        by_temperature: dict[float, list[float]] = {t: [] for t in temperatures}
        long_streams = 0
        while len(beside) < trials and time.perf_counter() < deadline:
            long_task = asyncio.create_task(stream_one(client, model, long_, long_tokens, logit_bias=no_eos))
            long_streams += 1
            await asyncio.sleep(0.3)  # the stream is decoding
            while not long_task.done() and len(beside) < trials and time.perf_counter() < deadline:
                r = await stream_one(
                    client, model, short, 16, logit_bias=no_eos, temperature=temperatures[len(beside) % 2]
                )
                if not long_task.done():  # counts only if the stream was running all along
                    by_temperature[temperatures[len(beside) % 2]].append(r["latency"])
                    beside.append(r["latency"])
                await asyncio.sleep(0.05)
            await long_task
    median = statistics.median(solo)
    p99, worst = pct(beside, 0.99), max(beside) if beside else float("nan")
    return {
        "trials": len(beside),
        "long_streams": long_streams,
        "solo_median_s": round(median, 4),
        "p50_s": round(statistics.median(beside), 4) if beside else None,
        "p99_s": round(p99, 4),
        "max_s": round(worst, 4),
        "p99_within_3x_solo_plus_0.5s": p99 <= 3 * median + 0.5,
        "max_within_2s": worst <= 2.0,
        "by_temperature": {
            str(t): {"p50_s": round(statistics.median(v), 4), "max_s": round(max(v), 4)}
            for t, v in by_temperature.items()
            if v
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--max-concurrent",
        type=int,
        nargs="+",
        default=[1, 4],
        help="one server per value; 1 is one request at a time (the behaviour before the scheduler)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="concurrent phases per server, taking turns")
    ap.add_argument("--no-short-beside-long", action="store_true", help="skip the 16-token-beside-1500 check")
    ap.add_argument(
        "--stall-trials",
        type=int,
        default=50,
        help="short requests timed during long streams, on a server with default settings (0: skip)",
    )
    ap.add_argument("--stall-only", action="store_true", help="run only the short-requests-during-long-streams phase")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    deadline = time.perf_counter() + args.time_limit
    report: dict = {"runs": {}}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        target, drafter = models(args, Path(tmp))
        model = model_name_for(target)
        n = args.clients * args.requests
        prompts = [f"Write Python code for {PROMPT_TOPICS[i % len(PROMPT_TOPICS)]} (variant {i})." for i in range(n)]
        servers = {}
        if args.stall_only:
            args.max_concurrent = []
        for mc in args.max_concurrent:
            serve_args = ["--model", target] + (["--draft-model", drafter] if drafter else ["--no-draft"])
            serve_args += [
                "--max-queue",
                str(args.clients * 2),
                "--request-timeout",
                str(args.time_limit),
                "--max-concurrent",
                str(mc),
                "--prompt-cache-dir",
                "none",
            ]
            servers[mc] = stack.enter_context(running_server(serve_args, Path(tmp) / f"server-{mc}.log", nice=False))
        from mlx_lm.utils import load_tokenizer

        no_eos = {str(t): -100 for t in load_tokenizer(Path(target)).eos_token_ids} if Path(target).exists() else {}
        if args.stall_trials > 0:
            # default settings (disk prompt cache on, in the temporary directory), as a user runs it
            serve_args = ["--model", target] + (["--draft-model", drafter] if drafter else ["--no-draft"])
            serve_args += ["--prompt-cache-dir", str(Path(tmp) / "prompt-cache")]
            os.environ.setdefault("DFLASH2_MLX_TRACE_STALLS", "0.5")  # the server logs its slow turns
            with running_server(serve_args, Path(tmp) / "server-defaults.log", nice=False) as srv:
                report["short_during_long"] = asyncio.run(
                    shorts_during_long_streams(srv.base, model, no_eos, args.stall_trials, deadline=deadline)
                )
                slow = [line.split("stall: ", 1)[1] for line in srv.log_text().splitlines() if "stall: " in line]
                report["short_during_long"]["slow_turns"] = {
                    "count": len(slow),
                    "slowest": sorted(slow, key=lambda line: -float(line.split(" took ", 1)[1].split(" ", 1)[0]))[:5],
                }
                if "Traceback" in srv.log_text():
                    report["short_during_long"]["server_errors"] = srv.log_text()[-2000:]
        if not servers:
            return _report(args, report)
        first = args.max_concurrent[0]  # the solo reference runs once, on the first server
        solo, wall = asyncio.run(solo_runs(servers[first].base, model, prompts, args.max_tokens, deadline))
        report["solo"] = summary(list(solo.values()), wall)
        for mc in servers:
            report["runs"][mc] = {"concurrent": []}
        results = {mc: [] for mc in servers}
        for _ in range(args.repeats):
            for mc, srv in servers.items():  # the servers take turns: same-run comparison
                res, wall = asyncio.run(
                    concurrent_runs(srv.base, model, prompts, args.clients, args.requests, args.max_tokens, deadline)
                )
                results[mc] += res
                report["runs"][mc]["concurrent"].append(summary(res, wall))
        for mc, srv in servers.items():
            run = report["runs"][mc]
            mismatches = [r["prompt"] for r in results[mc] if r["text"] != solo[r["prompt"]]["text"]]
            run["identical_to_solo"] = not mismatches
            run["mismatches"] = mismatches[:5]
            if not args.no_short_beside_long:
                run["short_beside_long"] = asyncio.run(short_beside_long(srv.base, model, no_eos))
            m = metrics(srv.base)
            run["server"] = {
                "acceptance_length": m.get("dflash2_mlx_acceptance_length"),
                "queue_depth_after": m.get("dflash2_mlx_queue_depth"),
                "active_after": m.get("dflash2_mlx_active_requests"),
            }
            if "Traceback" in srv.log_text():
                run["server_errors"] = srv.log_text()[-2000:]
        report["setup"] = {
            "model": target,
            "drafter": drafter,
            "clients": args.clients,
            "requests_per_client": args.requests,
            "max_tokens": args.max_tokens,
            "max_concurrent": args.max_concurrent,
            "repeats": args.repeats,
        }
    return _report(args, report)


def _report(args, report: dict) -> int:
    """Print the report (JSON or lines) -> the exit status: 0 when every check passed."""
    ok = all(r["identical_to_solo"] and "server_errors" not in r for r in report["runs"].values())
    sdl = report.get("short_during_long")
    if sdl:
        ok = ok and sdl["p99_within_3x_solo_plus_0.5s"] and sdl["max_within_2s"] and "server_errors" not in sdl
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if ok else 1
    if sdl:
        print(
            f"16-token requests during 1500-token streams (default settings): {sdl['trials']} trials over "
            f"{sdl['long_streams']} streams, p50 {sdl['p50_s']:.3f} s, p99 {sdl['p99_s']:.3f} s, "
            f"max {sdl['max_s']:.3f} s (solo median {sdl['solo_median_s']:.3f} s); "
            f"p99 <= 3x solo + 0.5 s: {sdl['p99_within_3x_solo_plus_0.5s']}; "
            f"max <= 2 s: {sdl['max_within_2s']}"
        )
        for line in sdl["slow_turns"]["slowest"]:
            print(f"  slow server turn: {line}")
    if "solo" in report:
        s = report["solo"]
        print(
            f"solo (reference): {s['requests']} requests in {s['wall_s']:.1f} s, {s['throughput_tok_s']} tok/s, "
            f"TTFT p50 {s['ttft_p50_s'] * 1000:.0f} ms p95 {s['ttft_p95_s'] * 1000:.0f} ms"
        )
        for mc, run in report["runs"].items():
            print(f"--max-concurrent {mc}")
            for c in run["concurrent"]:
                print(
                    f"  concurrent: {args.clients} clients x {args.requests} = {c['requests']} requests in {c['wall_s']:.1f} s, "
                    f"{c['throughput_tok_s']} tok/s, TTFT p50 {c['ttft_p50_s']:.2f} s p95 {c['ttft_p95_s']:.2f} s, "
                    f"latency p50 {c['latency_p50_s']:.2f} s p95 {c['latency_p95_s']:.2f} s"
                )
            print(
                f"  outputs identical to solo runs: {run['identical_to_solo']}; "
                f"acceptance length {run['server']['acceptance_length']}"
            )
            sb = run.get("short_beside_long")
            if sb:
                print(
                    f"  16 tokens beside a 1500-token stream: {sb['short_beside_latency_s']:.2f} s "
                    f"(solo {sb['short_solo_latency_s']:.2f} s; within 3x + 0.5 s: {sb['within_3x_plus_0.5s']}); "
                    f"long stream unchanged: {sb['long_text_unchanged']}"
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
