"""Fault test of `dflash2-mlx serve`: clients that vanish mid-request, and a SIGTERM mid-stream.

1. CLIENTS concurrent streaming clients drop their connection at random points: most after a
   random number of stream chunks (mid-stream), a quarter after a random short time (while still
   queued or during prefill). Then: /health answers 200, the queue is
   empty and the worker idle, every started generation ended as "cancelled" or finished, and a
   greedy request still returns exactly what it returned before the faults.
2. Memory back to baseline: SIGUSR1 makes the worker drop its prefix cache (no admin route); the
   script waits for /metrics to show an empty cache, then compares MLX active memory with the
   baseline measured right after the model loaded.
3. SIGTERM while one request streams and others wait: the stream ends with a final chunk and
   `data: [DONE]`, the waiting requests get a 503 (or finish), and the process exits 0.

    python benchmarks/server_faults.py [--model M --draft-model D] [--clients 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from server_helpers import labelled, metrics, running_server  # noqa: E402
from server_load import models  # noqa: E402

from dflash2_mlx.server.app import model_name_for  # noqa: E402

MEMORY_TOLERANCE = 1 * 2**20  # bytes of MLX active memory allowed above the baseline


async def vanishing_client(
    base: str, model: str, i: int, after_chunks: int, give_up_after: float, max_tokens: int
) -> dict:
    """Drops the connection after ``after_chunks`` stream chunks, or after ``give_up_after`` seconds
    (whichever comes first: a client still queued then gives up while waiting)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me a long story ({i})"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    chunks, state = 0, "queued"

    async def consume():
        nonlocal chunks, state
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                state = "streaming" if r.status_code == 200 else f"http {r.status_code}"
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if chunks >= after_chunks:
                            return True  # leaving the block closes the connection mid-stream
        return False

    try:
        gave_up = await asyncio.wait_for(consume(), give_up_after)
        return {"gave_up": gave_up, "state": state, "chunks": chunks}
    except asyncio.TimeoutError:
        return {"gave_up": True, "state": state, "chunks": chunks}


async def faults(base: str, model: str, clients: int, seed: int) -> dict:
    """Most clients leave mid-stream after a random number of chunks; a quarter of them give up
    after a random short time instead (usually while still queued, or during prefill)."""
    rng = random.Random(seed)
    plans = [(rng.randint(1, 40), rng.uniform(0.05, 2.0) if i % 4 == 3 else 600.0) for i in range(clients)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(vanishing_client(base, model, i, k, t, 4000) for i, (k, t) in enumerate(plans)))
    return {
        "clients": clients,
        "gave_up": sum(r["gave_up"] for r in results),
        "gave_up_while_queued": sum(r["gave_up"] and r["state"] == "queued" for r in results),
        "gave_up_mid_stream": sum(r["gave_up"] and r["state"] == "streaming" for r in results),
        "chunks_before_leaving": sorted(r["chunks"] for r in results),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def wait_idle(base: str, timeout: float = 30.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        h = httpx.get(base + "/health", timeout=5).json()
        m = metrics(base)
        if not h["busy"] and m["dflash2_mlx_queue_depth"] == 0 and m["dflash2_mlx_requests_in_flight"] == 0:
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise TimeoutError("the server did not become idle after the clients left")


def greedy(base: str, model: str) -> str:
    r = httpx.post(
        base + "/v1/chat/completions",
        timeout=120,
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Reference request"}],
            "max_tokens": 48,
            "temperature": 0,
        },
    )
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def sigterm_mid_stream(srv, model: str) -> dict:
    import threading

    streams: dict[int, list[str]] = {0: [], 1: [], 2: []}
    statuses: dict[int, int] = {}

    def reader(i: int) -> None:
        try:
            with httpx.stream(
                "POST",
                srv.base + "/v1/chat/completions",
                timeout=60,
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": f"stream {i}"}],
                    "max_tokens": 100000,
                    "stream": True,
                },
            ) as r:
                statuses[i] = r.status_code
                for line in r.iter_lines():
                    streams[i].append(line)
        except httpx.HTTPError as e:
            statuses[i] = -1
            streams[i].append(f"error {type(e).__name__}")

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(3)]
    threads[0].start()
    while sum(line.startswith("data:") for line in streams[0]) < 5:
        time.sleep(0.02)
    for t in threads[1:]:
        t.start()
    time.sleep(0.3)  # the other two are queued now
    t0 = time.perf_counter()
    code = srv.stop(signal.SIGTERM, timeout=30)
    exit_s = time.perf_counter() - t0
    for t in threads:
        t.join(10)
    data = [line[6:] for line in streams[0] if line.startswith("data: ")]
    final = json.loads(data[-2]) if len(data) >= 2 and data[-1] == "[DONE]" else None
    return {
        "exit_code": code,
        "exit_seconds": round(exit_s, 2),
        "stream_ended_with_done": bool(final),
        "final_finish_reason": final["choices"][0]["finish_reason"] if final else None,
        "waiting_statuses": [statuses.get(1), statuses.get(2)],
        "traceback_in_log": "Traceback" in srv.log_text(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = models(args, Path(tmp))
        model = model_name_for(target)
        serve_args = ["--model", target] + (["--draft-model", drafter] if drafter else ["--no-draft"])
        serve_args += ["--max-queue", str(args.clients * 2)]
        with running_server(serve_args, Path(tmp) / "server.log", nice=False) as srv:
            before = greedy(srv.base, model)
            m0 = metrics(srv.base)
            report["faults"] = asyncio.run(faults(srv.base, model, args.clients, args.seed))
            report["faults"]["idle_after_s"] = round(wait_idle(srv.base), 3)
            gens = labelled(srv.base, "dflash2_mlx_generations_total")
            report["faults"]["generations"] = {k.split('"')[1]: v for k, v in gens.items()}
            report["faults"]["health"] = httpx.get(srv.base + "/health").status_code
            report["faults"]["same_output_after"] = greedy(srv.base, model) == before
            # memory: drop the prefix cache (SIGUSR1), then compare with the post-load baseline
            m1 = metrics(srv.base)
            os.kill(srv.proc.pid, signal.SIGUSR1)
            deadline = time.monotonic() + 30
            while metrics(srv.base)["dflash2_mlx_prefix_cache_entries"] != 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            m2 = metrics(srv.base)
            base, active = m0["dflash2_mlx_baseline_memory_bytes"], m2["dflash2_mlx_active_memory_bytes"]
            report["memory"] = {
                "baseline_bytes": int(base),
                "with_prefix_cache_bytes": int(m1["dflash2_mlx_active_memory_bytes"]),
                "prefix_cache_bytes_before_clear": int(m1["dflash2_mlx_prefix_cache_bytes"]),
                "after_clear_bytes": int(active),
                "excess_bytes": int(active - base),
                "back_to_baseline": active <= base + MEMORY_TOLERANCE,
            }
            report["sigterm"] = sigterm_mid_stream(srv, model)
    ok = (
        report["faults"]["health"] == 200
        and report["faults"]["same_output_after"]
        and report["memory"]["back_to_baseline"]
        and report["sigterm"]["exit_code"] == 0
        and report["sigterm"]["stream_ended_with_done"]
        and not report["sigterm"]["traceback_in_log"]
    )
    report["ok"] = ok
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        f, mem, st = report["faults"], report["memory"], report["sigterm"]
        print(
            f"{f['clients']} vanishing clients ({f['gave_up_while_queued']} while queued, {f['gave_up_mid_stream']} mid-stream): "
            f"idle {f['idle_after_s']} s later, /health {f['health']}, generations {f['generations']}, "
            f"same greedy output after: {f['same_output_after']}"
        )
        print(
            f"memory: baseline {mem['baseline_bytes'] / 2**20:.2f} MiB, with prefix cache {mem['with_prefix_cache_bytes'] / 2**20:.2f} MiB, "
            f"after clearing it {mem['after_clear_bytes'] / 2**20:.2f} MiB (excess {mem['excess_bytes']} bytes)"
        )
        print(
            f"SIGTERM mid-stream: exit code {st['exit_code']} after {st['exit_seconds']} s; stream ended with [DONE]: "
            f"{st['stream_ended_with_done']} (finish_reason {st['final_finish_reason']}); waiting requests got {st['waiting_statuses']}"
        )
        print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
