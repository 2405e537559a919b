"""A process that served requests exits cleanly: no "terminate called without an active exception".

The abort came from MLX's per-thread compile cache (backend/threads.py): a thread that ran
compiled MLX code released it in a C++ thread-exit destructor after ``Thread.join()`` had
returned, and if the interpreter was finalising by then, the process died with SIGABRT (134).
Each case runs in fresh subprocesses, since only a process's own exit shows it, and repeats,
since the abort is a race (before the fix: about 8 in 10 runs of the first case, 9 in 10 of the
second).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import httpx
from server_helpers import running_server

TERMINATE = "terminate called"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def structured_requests(model: str) -> list[dict]:
    """A json_schema request and a forced tool call (the grammar paths the abort followed most)."""
    return [
        {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 12,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
        },
        {
            "model": model,
            "messages": [{"role": "user", "content": "weather?"}],
            "max_tokens": 12,
            "tools": TOOLS,
            "tool_choice": "required",
        },
    ]


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_a_thread_that_ran_compiled_mlx_code_cannot_abort_the_interpreter_exit():
    # The main thread keeps the GIL from the join to the finalisation (long switch interval), the
    # window in which an unreleased compile cache's destructor aborted the process.
    code = """
        import sys, threading
        import mlx.core as mx
        from dflash2_mlx.backend.threads import mlx_thread

        double_plus_one = mx.compile(lambda a: a * 2 + 1)
        def work():
            mx.eval(double_plus_one(mx.ones((4,))))
        sys.setswitchinterval(30)
        thread = threading.Thread(target=mlx_thread(work))
        thread.start()
        thread.join()
    """
    for _ in range(5):
        done = run_python(code, timeout=60)
        assert done.returncode == 0 and TERMINATE not in done.stderr, done.stderr[-2000:]


def test_an_in_process_app_joins_its_worker_and_the_process_exits_0(embedded_pair):
    # The pytest situation: an ASGI app run in process by TestClient, whose lifespan ends before
    # the interpreter does.
    target, drafter = embedded_pair
    code = f"""
        import dflash2_mlx  # before mlx.core: the BLAS preload
        from fastapi.testclient import TestClient
        from dflash2_mlx.server import ServerConfig, create_app
        from dflash2_mlx.server.worker import Worker

        worker = Worker({str(target)!r}, {str(drafter)!r}, block_size=8, prefix_cache_bytes=0)
        app = create_app(ServerConfig(model={str(target)!r}, draft_model={str(drafter)!r}), worker)
        with TestClient(app, raise_server_exceptions=False) as client:
            assert worker.ready.wait(60), worker.error
            for body in {structured_requests("tiny-code-demo-target")!r}:
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
        assert not worker._thread.is_alive(), "the lifespan's end did not join the worker thread"
    """
    for _ in range(3):
        done = run_python(code)
        assert done.returncode == 0 and TERMINATE not in done.stderr, done.stderr[-2000:]


def test_serve_exits_0_on_sigterm_after_json_schema_and_forced_tool_requests(embedded_pair, tmp_path):
    target, drafter = embedded_pair
    args = ["--model", str(target), "--draft-model", str(drafter), "--block-size", "8"]
    for run in range(2):
        log = tmp_path / f"serve-{run}.log"
        with running_server(args, log, nice=False) as server:
            for body in structured_requests("tiny-code-demo-target"):
                response = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
            exit_code = server.stop()
        assert exit_code == 0 and TERMINATE not in server.log_text(), server.log_text()[-3000:]
