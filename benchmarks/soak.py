"""Soak test of `dflash2-mlx serve`: minutes of mixed traffic on loopback, watched minute by minute.

Starts a server (the embedded pair unless --model/--draft-model; disk prompt cache on, in a
temporary directory, with small --prompt-cache-gb and --prefix-cache-gb budgets) as a subprocess on
127.0.0.1 and sends, from --clients concurrent clients for --minutes: chat requests, streams,
json_schema answers, forced tool calls, Anthropic and Responses requests (plain and streamed),
malformed requests (each must be answered 4xx), clients that disconnect mid-stream, bursts above
--max-concurrent plus the queue (429 answers, to them or to anyone while the queue is full, are
intended), and the same long system prompt again and again. It stops by itself: at the time
limit, or after --max-requests requests.

Per minute it reports requests and errors by status, p50 and p99 latency, the server's resident
memory (VmRSS), open file descriptors and threads (from /proc), and the prompt-cache bytes in
memory (the server's /metrics) and on disk (the cache directory's snapshot files). It writes a JSON
(--out) and prints a markdown table, then PASS/FAIL lines:

- no 5xx response (nor an error event inside a stream);
- every malformed request answered 4xx;
- resident memory after the first 5 minutes grows by at most 5% (checked from 10 minutes on);
- prompt-cache bytes within their budgets, in memory and on disk.

    python benchmarks/soak.py --minutes 30 [--clients 4] [--max-concurrent 2] [--out soak.json]

Exit status 0 when every check passed. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_helpers import metrics, running_server  # noqa: E402

from dflash2_mlx.server.app import model_name_for  # noqa: E402

# A long system prompt sent again and again: its prefix snapshot is what the prompt cache is for.
SYSTEM = " ".join(
    f"Rule {i}: answer in plain Python, keep names short, explain nothing unless asked, "
    "prefer the standard library, and never print secrets."
    for i in range(12)
)
QUESTIONS = [
    "Write a function that adds two numbers.",
    "Sort a list of words by length.",
    "Read a CSV file.",
    "Reverse a string.",
    "Parse a date.",
    "Retry a web request.",
    "Count words in a text.",
    "Compute a prime sieve.",
    "Flatten a nested list.",
    "Merge two dictionaries.",
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SAMPLE_EVERY = 10.0  # seconds between readings of the server's memory, descriptors, threads and caches


@dataclass
class Result:
    kind: str
    status: int  # HTTP status; 0 when the connection failed
    seconds: float
    minute: int
    expect_4xx: bool = False
    stream_error: bool = False  # a streamed response that carried an error event
    note: str = ""


class Traffic:
    """The clients' requests, one kind at a time, and their results."""

    def __init__(self, base: str, model: str, started: float, rng: random.Random):
        self.base, self.model, self.started, self.rng = base, model, started, rng
        self.results: list[Result] = []

    def minute(self) -> int:
        return int((time.monotonic() - self.started) // 60)

    def messages(self, system: bool = False) -> list[dict]:
        user = {"role": "user", "content": self.rng.choice(QUESTIONS)}
        return [{"role": "system", "content": SYSTEM}, user] if system else [user]

    # ---- the request kinds: (method, path, json body or raw bytes, streamed?, expect 4xx?) -------

    def chat(self) -> tuple:
        return "/v1/chat/completions", {"model": self.model, "messages": self.messages(), "max_tokens": 32}, False

    def chat_stream(self) -> tuple:
        body = {"model": self.model, "messages": self.messages(), "max_tokens": 48, "stream": True}
        return "/v1/chat/completions", body, True

    def long_system(self) -> tuple:
        body = {"model": self.model, "messages": self.messages(system=True), "max_tokens": 24, "temperature": 0}
        return "/v1/chat/completions", body, self.rng.random() < 0.5

    def json_schema(self) -> tuple:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "A person as JSON."}],
            "max_tokens": 48,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
        }
        return "/v1/chat/completions", body, False

    def forced_tool(self) -> tuple:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
            "max_tokens": 48,
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
        }
        return "/v1/chat/completions", body, self.rng.random() < 0.5

    def anthropic(self) -> tuple:
        body = {"model": self.model, "max_tokens": 32, "messages": self.messages(), "stream": self.rng.random() < 0.5}
        return "/v1/messages", body, body["stream"]

    def responses(self) -> tuple:
        body = {
            "model": self.model,
            "input": self.rng.choice(QUESTIONS),
            "max_output_tokens": 32,
            "stream": self.rng.random() < 0.5,
        }
        return "/v1/responses", body, body["stream"]

    def malformed(self) -> tuple:
        """A request a client got wrong: the server must answer 4xx."""
        m = self.model
        bad = self.rng.choice(
            [
                ("/v1/chat/completions", b"{not json"),
                ("/v1/chat/completions", {"model": m}),  # no messages
                ("/v1/chat/completions", {"model": m, "messages": self.messages(), "max_tokens": -5}),
                ("/v1/chat/completions", {"model": m, "messages": self.messages(), "temperature": -1}),
                ("/v1/chat/completions", {"model": "no-such-model", "messages": self.messages()}),
                (
                    "/v1/chat/completions",
                    {
                        "model": m,
                        "messages": self.messages(),
                        "response_format": {"type": "json_schema", "json_schema": {"schema": 7}},
                    },
                ),
                ("/v1/chat/completions", {"model": m, "messages": [{"role": "wizard", "content": "hi"}]}),
                ("/v1/messages", {"model": m, "max_tokens": 16, "messages": "hello"}),  # messages must be a list
                ("/v1/responses", {"model": m, "input": 42}),
                ("/v1/completions", {"model": m, "prompt": "x", "max_tokens": "many"}),
            ]
        )
        return bad[0], bad[1], False

    # ---- sending ---------------------------------------------------------------------------------

    async def send(
        self,
        client: httpx.AsyncClient,
        kind: str,
        path: str,
        body,
        stream: bool,
        expect_4xx: bool = False,
        disconnect: bool = False,
    ) -> Result:
        t0, minute = time.monotonic(), self.minute()
        kw = (
            {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body}
        )
        status, stream_error, note = 0, False, ""
        try:
            if not stream:
                r = await client.post(path, **kw)
                status = r.status_code
                if status >= 400 and not expect_4xx:
                    note = r.text[:200]
            else:
                async with client.stream("POST", path, **kw) as r:
                    status = r.status_code
                    if status >= 400:  # refused before streaming: a JSON error body
                        note = (await r.aread())[:200].decode(errors="replace")
                    else:
                        async for line in r.aiter_lines():
                            if disconnect and line.startswith("data:"):
                                break  # the client goes away mid-stream: closing the response drops the connection
                            if line.startswith("event: error") or (line.startswith("data:") and '"error"' in line[:40]):
                                stream_error, note = True, line[:200]
        except (httpx.HTTPError, httpx.StreamError) as e:
            note = f"{type(e).__name__}: {e}"[:200]
        if expect_4xx and not 400 <= status < 500:
            note = f"{path} {str(body)[:150]} -> {note or status}"
        result = Result(kind, status, time.monotonic() - t0, minute, expect_4xx, stream_error, note)
        self.results.append(result)
        return result

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(
            [
                "chat",
                "chat_stream",
                "long_system",
                "json_schema",
                "forced_tool",
                "anthropic",
                "responses",
                "malformed",
                "disconnect",
            ],
            weights=[3, 3, 4, 2, 2, 2, 2, 2, 1],
        )[0]
        if kind == "disconnect":
            path, body, _ = self.chat_stream()
            body["max_tokens"] = 200
            await self.send(client, kind, path, body, True, disconnect=True)
        else:
            path, body, stream = getattr(self, kind)()
            await self.send(client, kind, path, body, stream, expect_4xx=kind == "malformed")

    async def burst(self, client: httpx.AsyncClient, size: int) -> None:
        """``size`` requests at once: above --max-concurrent plus the queue, some get 429."""
        await asyncio.gather(*(self.send(client, "burst", *self.chat()) for _ in range(size)))


def read_proc(pid: int) -> dict:
    """The server's resident memory (bytes), open file descriptors and threads, from /proc."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_bytes"] = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def disk_bytes(cache_dir: Path) -> int:
    """Bytes of the snapshot files in the prompt cache directory (temporary files excluded)."""
    snapshots = cache_dir / "snapshots"
    if not snapshots.exists():
        return 0
    return sum(f.stat().st_size for f in snapshots.glob("*.safetensors") if f.is_file())


async def sampler(base: str, pid: int, cache_dir: Path, started: float, stop: asyncio.Event, out: list) -> None:
    """Every SAMPLE_EVERY seconds: the server's /proc figures and prompt-cache bytes."""
    while True:
        m = await asyncio.to_thread(_metrics_or_empty, base)
        out.append(
            {
                "t": round(time.monotonic() - started, 1),
                "minute": int((time.monotonic() - started) // 60),
                **read_proc(pid),
                "prefix_cache_bytes": m.get("dflash2_mlx_prefix_cache_bytes"),
                "prompt_cache_disk_bytes_metric": m.get("dflash2_mlx_prompt_cache_disk_bytes"),
                "prompt_cache_disk_bytes": disk_bytes(cache_dir),
            }
        )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)
        if stop.is_set():
            return


def _metrics_or_empty(base: str) -> dict:
    try:
        return metrics(base)
    except (httpx.HTTPError, ValueError):
        return {}


async def run_traffic(args, base: str, model: str, pid: int, cache_dir: Path) -> tuple[list[Result], list[dict]]:
    started = time.monotonic()
    deadline = started + args.minutes * 60
    traffic = Traffic(base, model, started, random.Random(args.seed))
    samples: list[dict] = []
    stop = asyncio.Event()
    burst_size = args.max_concurrent + args.max_queue + 2
    limits = httpx.Limits(max_connections=args.clients + burst_size + 4)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        watcher = asyncio.create_task(sampler(base, pid, cache_dir, started, stop, samples))

        async def client_loop(c: int) -> None:
            next_burst = started + 20 + 10 * c
            while time.monotonic() < deadline and len(traffic.results) < args.max_requests:
                if c == 0 and time.monotonic() >= next_burst:  # one client bursts every --burst-every seconds
                    next_burst += args.burst_every
                    await traffic.burst(client, burst_size)
                else:
                    await traffic.one(client)

        await asyncio.gather(*(client_loop(c) for c in range(args.clients)))
        stop.set()
        await watcher
    return traffic.results, samples


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def per_minute(results: list[Result], samples: list[dict]) -> list[dict]:
    rows = []
    minutes = sorted({r.minute for r in results} | {s["minute"] for s in samples})
    by_minute = defaultdict(list)
    for r in results:
        by_minute[r.minute].append(r)
    for minute in minutes:
        rs = by_minute.get(minute, [])
        latencies = [r.seconds for r in rs if r.status == 200 and r.kind != "disconnect"]
        last = [s for s in samples if s["minute"] == minute]
        last = last[-1] if last else {}
        statuses = Counter(r.status for r in rs)
        rows.append(
            {
                "minute": minute + 1,
                "requests": len(rs),
                "by_status": dict(sorted(statuses.items())),
                "errors": sum(r.status != 200 for r in rs),
                "unexpected_errors": sum(_unexpected(r) for r in rs),
                "p50_s": round(statistics.median(latencies), 3) if latencies else None,
                "p99_s": round(pct(latencies, 0.99), 3) if latencies else None,
                "rss_mb": round(last["rss_bytes"] / 2**20, 1) if "rss_bytes" in last else None,
                "fds": last.get("fds"),
                "threads": last.get("threads"),
                "prefix_cache_mb": _mb(last.get("prefix_cache_bytes")),
                "disk_cache_mb": _mb(last.get("prompt_cache_disk_bytes")),
            }
        )
    return rows


def _mb(n) -> float | None:
    return None if n is None else round(n / 2**20, 2)


def _unexpected(r: Result) -> bool:
    """An error that is not the point of the request: a failed connection, a 5xx, a stream error,
    a 4xx to a well-formed request other than 429 (the queue was full, as the bursts make it)."""
    if r.status == 0 and r.kind != "disconnect":
        return True
    if r.status >= 500 or r.stream_error:
        return True
    return 400 <= r.status < 500 and not r.expect_4xx and r.status != 429


def markdown(rows: list[dict]) -> str:
    head = (
        "| minute | requests | by status | errors | p50 s | p99 s | RSS MB | fds | threads "
        "| prefix cache MB | disk cache MB |"
    )
    lines = [head, "|" + "|".join("---" for _ in range(11)) + "|"]
    for r in rows:
        status = " ".join(f"{k}:{v}" for k, v in r["by_status"].items())
        lines.append(
            f"| {r['minute']} | {r['requests']} | {status} | {r['errors']} | {r['p50_s']} | {r['p99_s']} | "
            f"{r['rss_mb']} | {r['fds']} | {r['threads']} | {r['prefix_cache_mb']} | {r['disk_cache_mb']} |"
        )
    return "\n".join(lines)


def checks(args, results: list[Result], samples: list[dict]) -> list[tuple[str, bool | None, str]]:
    """(check, passed or None when not applicable, detail)."""
    out = []
    server_errors = [r for r in results if r.status >= 500 or r.stream_error]
    out.append(
        (
            "no 5xx responses",
            not server_errors,
            f"{len(server_errors)} of {len(results)}" + (f"; first: {server_errors[0].note}" if server_errors else ""),
        )
    )
    malformed = [r for r in results if r.expect_4xx]
    wrong = [r for r in malformed if not 400 <= r.status < 500]
    out.append(
        (
            "every malformed request answered 4xx",
            bool(malformed) and not wrong,
            f"{len(malformed) - len(wrong)} of {len(malformed)}",
        )
    )
    other = [r for r in results if _unexpected(r) and r not in server_errors]
    out.append(
        (
            "no other unexpected failures (connection errors, 4xx to good requests)",
            not other,
            f"{len(other)}" + (f"; first: {other[0].kind} {other[0].status} {other[0].note}" if other else ""),
        )
    )
    after5 = [s for s in samples if s["t"] >= 300 and "rss_bytes" in s]
    if args.minutes >= 10 and after5:
        base, end = after5[0]["rss_bytes"], after5[-1]["rss_bytes"]
        growth = end / base - 1
        out.append(
            (
                "resident memory after minute 5 grows by at most 5%",
                growth <= 0.05,
                f"{base / 2**20:.0f} MB -> {end / 2**20:.0f} MB ({growth:+.1%})",
            )
        )
    else:
        out.append(("resident memory after minute 5 grows by at most 5%", None, "needs --minutes 10 or more"))
    memory = max((s["prefix_cache_bytes"] or 0 for s in samples), default=0)
    disk = max((s["prompt_cache_disk_bytes"] for s in samples), default=0)
    memory_budget, disk_budget = args.prefix_cache_gb * 2**30, args.prompt_cache_gb * 2**30  # as serve reads them
    out.append(
        (
            "prompt-cache bytes within budgets",
            memory <= memory_budget and disk <= disk_budget,
            f"memory max {memory / 2**20:.1f} MB of {memory_budget / 2**20:.1f} MB; "
            f"disk max {disk / 2**20:.1f} MB of {disk_budget / 2**20:.1f} MB",
        )
    )
    return out


def default_models() -> tuple[str, str]:
    from dflash2_mlx import assets

    return str(assets.demo_target_path()), str(assets.demo_drafter_path())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long to send traffic")
    ap.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--clients", type=int, default=4, help="concurrent client loops")
    ap.add_argument("--max-concurrent", type=int, default=2, help="the server's --max-concurrent")
    ap.add_argument("--max-queue", type=int, default=4, help="the server's --max-queue")
    ap.add_argument(
        "--burst-every", type=float, default=60.0, help="seconds between bursts above the server's capacity"
    )
    ap.add_argument("--prompt-cache-gb", type=float, default=0.02, help="the server's disk prompt-cache budget")
    ap.add_argument("--prefix-cache-gb", type=float, default=0.02, help="the server's in-memory prefix-cache budget")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="soak.json", help="where to write the JSON report")
    args = ap.parse_args()
    if args.minutes <= 0 or args.clients < 1:
        ap.error("--minutes must be positive and --clients at least 1")
    target, drafter = (args.model, args.draft_model) if args.model else default_models()
    model = model_name_for(target)
    with tempfile.TemporaryDirectory(prefix="dflash2-soak-") as tmp:
        cache_dir = Path(tmp) / "prompt-cache"
        serve_args = ["--model", target] + (["--draft-model", drafter] if drafter else ["--no-draft"])
        serve_args += [
            "--max-concurrent",
            str(args.max_concurrent),
            "--max-queue",
            str(args.max_queue),
            "--prompt-cache-dir",
            str(cache_dir),
            "--prompt-cache-gb",
            str(args.prompt_cache_gb),
            "--prefix-cache-gb",
            str(args.prefix_cache_gb),
            "--request-timeout",
            str(args.request_timeout),
        ]
        log = Path(tmp) / "server.log"
        with running_server(serve_args, log, wait=300) as srv:  # nice -n 19 execs the server: same pid
            results, samples = asyncio.run(run_traffic(args, srv.base, model, srv.proc.pid, cache_dir))
            exit_code = srv.stop()
            server_log = srv.log_text()
    rows = per_minute(results, samples)
    verdicts = checks(args, results, samples)
    tracebacks = server_log.count("Traceback")
    verdicts.append(
        (
            "server exited cleanly on SIGTERM, no traceback in its log",
            exit_code == 0 and not tracebacks,
            f"exit {exit_code}, {tracebacks} tracebacks",
        )
    )
    report = {
        "setup": {k: v for k, v in vars(args).items()},
        "target": target,
        "drafter": drafter,
        "minutes": rows,
        "samples": samples,
        "by_kind": _by_kind(results),
        "checks": [{"check": c, "passed": p, "detail": d} for c, p, d in verdicts],
        "slowest": [asdict(r) for r in sorted(results, key=lambda r: -r.seconds)[:10]],
        "failures": [asdict(r) for r in results if _unexpected(r) or (r.expect_4xx and not 400 <= r.status < 500)][:50],
        "server_log_tail": server_log[-3000:] if tracebacks or exit_code != 0 else "",
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(markdown(rows))
    print()
    for check, passed, detail in verdicts:
        print(f"{'PASS' if passed else 'FAIL' if passed is not None else 'N/A '} {check}: {detail}")
    print(f"(report written to {args.out})")
    return 0 if all(p is not False for _, p, _ in verdicts) else 1


def _by_kind(results: list[Result]) -> dict:
    out: dict = defaultdict(Counter)
    for r in results:
        out[r.kind][str(r.status)] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


if __name__ == "__main__":
    sys.exit(main())
