"""Several requests at once through a real `serve` process: interleaved cycle by cycle, every
output equal to its solo run, and a short request answered beside a long stream."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import metrics, running_server

NO_EOS = {"0": -100, "2": -100}  # the embedded pair's end tokens: lengths are exactly max_tokens


@pytest.fixture(scope="module")
def server(embedded_pair, tmp_path_factory):
    target, drafter = embedded_pair
    log = tmp_path_factory.mktemp("serve-concurrent") / "server.log"
    args = [
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--max-concurrent",
        "4",
        "--max-queue",
        "32",
        "--request-timeout",
        "300",
    ]
    with running_server(args, log) as srv:
        yield srv
    assert "Traceback" not in srv.log_text(), srv.log_text()[-3000:]


def complete(base: str, prompt: str, max_tokens: int, **kw) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_EOS, **kw}
    r = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def model_name(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_a_short_request_beside_a_long_stream_is_answered_while_the_stream_has_moved_on_little(server):
    """Fairness counted in the long stream's own chunks, not in seconds (a machine's speed must
    not decide the test): while the 16-token request is answered, the 1500-token stream beside it
    advances by a few chunks per short-request cycle, not by the whole stream (first come, first
    served) nor by many chunks per cycle (a scheduler that starves the newcomer)."""
    name = model_name(server.base)
    short_prompt, long_prompt = "def add(a, b):", "class Parser:\n    def __init__(self"
    complete(server.base, short_prompt, 16, model=name)  # warm-up
    t0 = time.perf_counter()
    short_solo = complete(server.base, short_prompt, 16, model=name)
    solo = time.perf_counter() - t0  # for the failure message only
    long_solo = complete(server.base, long_prompt, 1500, model=name)
    assert long_solo["usage"]["completion_tokens"] == 1500

    chunks, started = [], threading.Event()

    def stream_long():
        body = {
            "model": name,
            "prompt": long_prompt,
            "max_tokens": 1500,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "stream": True,
        }
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(httpx.Response(200, content=line[6:]).json())
                    if len(chunks) >= 20:
                        started.set()

    reader = threading.Thread(target=stream_long)
    reader.start()
    assert started.wait(120), "the long stream did not start"
    t0, before = time.perf_counter(), len(chunks)
    short_beside = complete(server.base, short_prompt, 16, model=name)
    beside, during = time.perf_counter() - t0, len(chunks) - before
    still_streaming = reader.is_alive()
    reader.join(300)
    assert still_streaming, "the long stream ended before the short request was answered: make it longer"
    # 16 tokens take at most 16 cycles of the short request; the HTTP round trip lets the stream
    # run on a little too (7 chunks here). First come first served, it would be all ~390 of them.
    assert during <= 100, (during, len(chunks), beside, solo)
    assert short_beside["choices"][0]["text"] == short_solo["choices"][0]["text"]
    long_text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert long_text == long_solo["choices"][0]["text"]


def test_concurrent_clients_get_their_solo_outputs(server):
    name = model_name(server.base)
    prompts = [f"def task_{i}(x):\n    " for i in range(6)] + ["import os\n", "for i in range(10):"]
    lengths = [24, 40, 8, 64, 16, 32, 48, 12]  # ragged, so requests start and end at different cycles
    solo = {p: complete(server.base, p, n, model=name)["choices"][0]["text"] for p, n in zip(prompts, lengths)}
    peak = {"active": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak["active"] = max(peak["active"], metrics(server.base).get("dflash2_mlx_active_requests", 0))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    jobs = [(p, n) for p, n in zip(prompts, lengths)] * 2
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda pn: (pn[0], complete(server.base, pn[0], pn[1], model=name)), jobs))
    stop.set()
    watcher.join()
    for prompt, body in got:
        assert body["choices"][0]["text"] == solo[prompt], prompt
        assert body["usage"]["completion_tokens"] == dict(zip(prompts, lengths))[prompt]
        assert body["speculative"]["controller"]["policy"] == "auto"  # the default: the break-even controller
    assert peak["active"] >= 2, "requests never decoded at the same time"
    m = metrics(server.base)
    assert m["dflash2_mlx_active_requests"] == 0 and m["dflash2_mlx_queue_depth"] == 0


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_batched_verify_gives_concurrent_clients_their_solo_outputs(embedded_pair, tmp_path, mode):
    """--batch-verify on (every round of two or more cycles is one batched target pass) and auto
    (measured, so both modes run): each concurrent request's text is its solo text."""
    target, drafter = embedded_pair
    args = [
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--max-concurrent",
        "4",
        "--max-queue",
        "32",
        "--request-timeout",
        "300",
        "--batch-verify",
        mode,
    ]
    with running_server(args, tmp_path / "server.log") as srv:
        name = model_name(srv.base)
        prompts = [f"def task_{i}(x):\n    " for i in range(4)] + ["import os\n", "for i in range(10):"]
        lengths = [40, 24, 64, 16, 48, 32]  # ragged: the batch shrinks and blocks shorten as they end
        solo = {p: complete(srv.base, p, n, model=name)["choices"][0]["text"] for p, n in zip(prompts, lengths)}
        with ThreadPoolExecutor(6) as pool:
            got = list(
                pool.map(
                    lambda pn: (pn[0], complete(srv.base, pn[0], pn[1], model=name)), list(zip(prompts, lengths)) * 2
                )
            )
        for prompt, body in got:
            assert body["choices"][0]["text"] == solo[prompt], prompt
            assert body["usage"]["completion_tokens"] == dict(zip(prompts, lengths))[prompt]
        m = metrics(srv.base)
        assert m["dflash2_mlx_batched_verify_calls_total"] > 0, "no verify pass was ever batched"
        assert m["dflash2_mlx_batched_verify_passes_total"] >= 2 * m["dflash2_mlx_batched_verify_calls_total"]
    assert "Traceback" not in srv.log_text(), srv.log_text()[-3000:]


def test_an_unknown_batch_verify_mode_is_a_one_line_error():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "dflash2_mlx", "serve", "--batch-verify", "maybe"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "--batch-verify must be auto, on or off" in r.stderr
