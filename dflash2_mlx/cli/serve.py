"""`dflash2-mlx serve`: the OpenAI- and Anthropic-compatible local server."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
from typing import List, Optional

import typer

from dflash2_mlx.cli.common import (
    block_size_option,
    copy_drafting_option,
    draft_option,
    model_option,
    prompt_cache_option,
)


def serve_command(
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_option(),
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to listen on (loopback by default; 0.0.0.0 exposes the server to the network).",
    ),
    port: int = typer.Option(8080, "--port", help="TCP port (0: any free port)."),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        envvar="DFLASH2_API_KEY",
        help="Require this key: 'Authorization: Bearer KEY' (OpenAI routes) or 'x-api-key: KEY' (/v1/messages; "
        "/v1/models takes either).",
    ),
    allowed_origins: List[str] = typer.Option(
        [],
        "--allowed-origins",
        help="Enable CORS for these browser origins (repeatable or comma-separated; '*' for any). Off by default.",
    ),
    max_queue: int = typer.Option(
        64, "--max-queue", help="Requests that may wait for the generation worker; more get 429 with Retry-After."
    ),
    max_concurrent: int = typer.Option(
        4, "--max-concurrent", help="Requests that decode at once, taking turns cycle by cycle; more wait in the queue."
    ),
    batch_verify: str = typer.Option(
        "auto",
        "--batch-verify",
        help="Run the active requests' verify passes as one batched target call: on, off, or auto (measured while "
        "serving: whichever is faster). Outputs are the same either way.",
    ),
    max_context: Optional[int] = typer.Option(
        None, "--max-context", help="Refuse prompts of this many tokens or more (default: the model's context)."
    ),
    served_model_name: List[str] = typer.Option(
        [], "--served-model-name", help="Extra model name(s) clients may use (repeatable); listed by /v1/models."
    ),
    no_draft: bool = typer.Option(False, "--no-draft", help="Serve with plain autoregressive decoding (no drafter)."),
    block_size: str = block_size_option(),
    no_copy_drafting: bool = copy_drafting_option(),
    copy_index_mb: float = typer.Option(
        64.0,
        "--copy-index-mb",
        help="Memory per API key for earlier answers that later requests may draft by copying (0: keep none; "
        "copies of a request's own prompt and answer still happen). Kept in memory only.",
    ),
    prefix_cache_gb: float = typer.Option(
        2.0, "--prefix-cache-gb", help="Memory for prompt-prefix cache snapshots, in GB (0 disables)."
    ),
    prompt_cache_dir: Optional[str] = prompt_cache_option(),
    prompt_cache_gb: float = typer.Option(
        8.0,
        "--prompt-cache-gb",
        help="Disk budget of the prompt cache directory, in GB; least recently used snapshots go first.",
    ),
    request_timeout: float = typer.Option(
        600.0,
        "--request-timeout",
        help="Seconds a request may take, queue wait included; a generation still running is cut short (finish_reason "
        "'length').",
    ),
    default_max_tokens: Optional[int] = typer.Option(
        None,
        "--default-max-tokens",
        help="max_tokens for requests that give none. Default: the model's generation_config.json max_new_tokens, else "
        "4096.",
    ),
    log_level: str = typer.Option("info", "--log-level", help="critical, error, warning, info or debug."),
) -> None:
    """Serve the model over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/responses,
    /v1/models) and Anthropic (/v1/messages) APIs, plus /health and /metrics."""
    from dflash2_mlx.cli.common import (
        choose_models,
        fail,
        parse_block_size,
        prompt_cache_location,
        warn_if_reference_blas,
    )

    for name, value, low in (
        ("--max-queue", max_queue, 1),
        ("--max-concurrent", max_concurrent, 1),
        ("--default-max-tokens", default_max_tokens, 1),
        ("--max-context", max_context, 2),
    ):
        if value is not None and value < low:
            fail(f"{name} must be at least {low}, got {value}")
    if batch_verify not in ("auto", "on", "off"):
        fail(f"--batch-verify must be auto, on or off, got {batch_verify!r}")
    if not 0 <= port <= 65535:
        fail(f"--port must be in 0..65535, got {port}")
    if prefix_cache_gb < 0:
        fail(f"--prefix-cache-gb must be >= 0, got {prefix_cache_gb}")
    if prompt_cache_gb < 0:
        fail(f"--prompt-cache-gb must be >= 0, got {prompt_cache_gb}")
    if copy_index_mb < 0:
        fail(f"--copy-index-mb must be >= 0, got {copy_index_mb}")
    cache_dir = prompt_cache_location(prompt_cache_dir)
    if request_timeout <= 0:
        fail(f"--request-timeout must be > 0, got {request_timeout}")
    levels = {"critical", "error", "warning", "info", "debug"}
    if log_level.lower() not in levels:
        fail(f"--log-level must be one of {sorted(levels)}, got {log_level}")
    if api_key is not None and not api_key.strip():
        fail("--api-key is empty")
    origins = [o.strip() for item in allowed_origins for o in item.split(",") if o.strip()]
    choice = choose_models(model, draft_model, None, need_draft=not no_draft)
    _check_local_paths(choice)
    from dflash2_mlx.models import memory

    try:  # before the worker downloads anything: a pair that cannot fit ends here, in one line
        memory.preflight(choice.target, choice.drafter, max_context, label=choice.label)
    except (memory.DoesNotFit, ValueError) as e:
        fail(str(e))
    warn_if_reference_blas()
    pinned = parse_block_size(block_size)
    if pinned is not None and pinned < 2:
        fail(f"--block-size must be auto or at least 2, got {pinned}")

    try:
        import uvicorn

        from dflash2_mlx.server import ServerConfig, create_app
        from dflash2_mlx.server.app import model_name_for
        from dflash2_mlx.server.worker import Worker
    except ImportError as e:
        fail(f"`serve` needs FastAPI and uvicorn ({e}); install them with `pip install fastapi uvicorn`")

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    sock = _bind(host, port, fail)
    bound_port = sock.getsockname()[1]
    config = ServerConfig(
        model=choice.target,
        draft_model=choice.drafter,
        api_key=api_key,
        allowed_origins=origins,
        max_queue=max_queue,
        max_concurrent=max_concurrent,
        batch_verify=batch_verify,
        max_context=max_context,
        served_model_names=served_model_name,
        prefix_cache_gb=prefix_cache_gb,
        prompt_cache_dir=cache_dir,
        prompt_cache_gb=prompt_cache_gb,
        request_timeout=request_timeout,
        default_max_tokens=default_max_tokens,
        model_name=model_name_for(choice.target),
        copy_drafting=not no_copy_drafting,
        copy_index_mb=copy_index_mb,
    )
    worker = Worker(
        config.model,
        config.draft_model,
        max_queue=max_queue,
        max_concurrent=max_concurrent,
        batch_verify=batch_verify,
        max_context=max_context,
        prefix_cache_bytes=int(prefix_cache_gb * 2**30),
        prompt_cache_dir=cache_dir,
        prompt_cache_bytes=int(prompt_cache_gb * 2**30),
        block_size=pinned,
        copy_drafting=config.copy_drafting,
        copy_index_bytes=int(copy_index_mb * 2**20),
    )
    app = create_app(config, worker)
    server = _Server(
        uvicorn.Config(
            app, log_level=log_level.lower(), timeout_graceful_shutdown=15, timeout_keep_alive=30, lifespan="on"
        ),
        worker,
    )

    def fatal(message: str) -> None:
        server.should_exit = True

    worker.on_fatal = fatal
    shown = f"[{host}]" if ":" in host else host
    typer.echo(
        f"dflash2-mlx: serving {config.model_name} ({'no drafter' if choice.drafter is None else 'speculative'}) "
        f"at http://{shown}:{bound_port}/v1 (loading the model; /health answers 200 when ready)",
        err=True,
    )
    server.run(sockets=[sock])
    if worker.error:
        from dflash2_mlx.models.loading import LoadError

        raise LoadError(worker.error)


def _check_local_paths(choice) -> None:
    """Refuse a missing local directory at once (repo ids are resolved, and downloaded, by the worker)."""
    from pathlib import Path

    from dflash2_mlx.models.loading import resolve

    for spec, what in ((choice.target, "model"), (choice.drafter, "draft model")):
        if spec is None:
            continue
        if Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
            resolve(spec, what)  # raises LoadError with one line


def _bind(host: str, port: int, fail) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = e.strerror or str(e)
        hint = "another process uses the port; pass --port" if e.errno in (98, 48) else "check --host"
        fail(f"cannot listen on {host}:{port}: {reason} ({hint})")
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server; a first SIGINT/SIGTERM stops the worker (queued requests get 503, the
        active generations are cancelled and their streams end normally), then uvicorn drains the
        connections. The process exits 0 instead of re-raising the signal."""

        def __init__(self, config, worker):
            super().__init__(config)
            self.worker = worker

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                threading.Thread(target=self.worker.shutdown, name="dflash2-shutdown", daemon=True).start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGBREAK] if hasattr(signal, "SIGBREAK") else [])
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in original.items():
                    signal.signal(s, handler)

    return Server


def _Server(config, worker):
    return _server_class()(config, worker)
