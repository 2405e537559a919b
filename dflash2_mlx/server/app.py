"""The FastAPI app: its lifespan, error shapes and middleware, and the routers, on top of one ``Worker``.

The routes live in one router per API surface (``openai.routes``, ``responses.routes``,
``anthropic.routes``, ``admin``); what they share (the state, the key checks, reading a
body) in ``dependencies``; the settings in ``config``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from dflash2_mlx.server import admin
from dflash2_mlx.server.anthropic import routes as anthropic_routes
from dflash2_mlx.server.config import ServerConfig, model_name_for
from dflash2_mlx.server.dependencies import ServerState
from dflash2_mlx.server.errors import APIError, bad_request, describe_validation_error, error_body
from dflash2_mlx.server.metrics import Metrics
from dflash2_mlx.server.openai import routes as openai_routes
from dflash2_mlx.server.responses import routes as responses_routes
from dflash2_mlx.server.responses.store import ResponseStore
from dflash2_mlx.server.worker import Worker

# `serve` and the benchmarks import these from here
__all__ = ["ServerConfig", "create_app", "model_name_for"]

log = logging.getLogger("dflash2_mlx.server")

KNOWN_ROUTES = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/v1/responses",
    "/v1/embeddings",
    "/health",
    "/metrics",
}


class _Middleware:
    """Request ids, the body size limit, request metrics and the last-resort 500 (pure ASGI, so
    streaming and disconnect detection are untouched)."""

    def __init__(self, app, metrics: Metrics, max_body: int):
        self.app, self.metrics, self.max_body = app, metrics, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = f"req_{uuid.uuid4().hex[:16]}"
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        route = path if path in KNOWN_ROUTES or path.startswith(("/v1/models/", "/v1/responses/")) else "other"
        if route.startswith("/v1/models/"):
            route = "/v1/models/{id}"
        elif route.startswith("/v1/responses/"):
            route = "/v1/responses/{id}"
        status = {"code": 0}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", rid.encode())]
            await send(message)

        length = dict(scope.get("headers", [])).get(b"content-length")
        try:
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                raise (
                    APIError(413, f"the request body is larger than {self.max_body} bytes", code="request_too_large")
                    if length.isdigit()
                    else bad_request("invalid Content-Length header")
                )
            received = {"n": 0}

            async def receive_limited():
                message = await receive()
                if message["type"] == "http.request":
                    received["n"] += len(message.get("body", b""))
                    if received["n"] > self.max_body:
                        raise APIError(
                            413, f"the request body is larger than {self.max_body} bytes", code="request_too_large"
                        )
                return message

            await self.app(scope, receive_limited, send_wrapper)
        except APIError as e:
            if status["code"] == 0:
                await _send_error(send_wrapper, e, path)
        except Exception:
            log.exception("request %s %s failed", rid, path)
            if status["code"] == 0:
                await _send_error(
                    send_wrapper,
                    APIError(
                        500,
                        f"internal server error; the server log has the details under request id {rid}",
                        code="internal_error",
                    ),
                    path,
                )
        finally:
            self.metrics.request(route, status["code"] or 499)


async def _send_error(send, err: APIError, path: str) -> None:
    body = json.dumps(error_body(err, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _make_worker(config: ServerConfig, metrics: Metrics) -> Worker:
    return Worker(
        config.model,
        config.draft_model,
        max_queue=config.max_queue,
        max_concurrent=config.max_concurrent,
        batch_verify=config.batch_verify,
        max_context=config.max_context,
        prefix_cache_bytes=int(config.prefix_cache_gb * 2**30),
        prompt_cache_dir=config.prompt_cache_dir,
        prompt_cache_bytes=int(config.prompt_cache_gb * 2**30),
        metrics=metrics,
        copy_drafting=config.copy_drafting,
        copy_index_bytes=int(config.copy_index_mb * 2**20),
    )


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    """Start the worker (unless a test started it), clear the prefix cache on SIGUSR1, and stop and
    join the worker on the way out."""
    worker: Worker = app.state.worker
    if not worker._thread.is_alive() and worker.state == "loading":
        worker.start()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
        loop.add_signal_handler(signal.SIGUSR1, worker.request_clear_cache)
    try:
        yield
    finally:
        worker.shutdown()
        await asyncio.to_thread(worker.join, 10.0)


# ---- error shapes: OpenAI's or Anthropic's, by path (errors.error_body) -----------------------


async def _api_error(request: Request, exc: APIError):
    return JSONResponse(error_body(exc, request.url.path), status_code=exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError):
    return await _api_error(request, describe_validation_error(list(exc.errors())))


async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        err = APIError(
            404,
            f"no route {request.method} {request.url.path}; the API is under /v1 "
            "(chat/completions, completions, responses, messages, models)",
            code="not_found",
        )
    elif exc.status_code == 405:
        err = APIError(405, f"method {request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    else:
        err = APIError(exc.status_code, str(exc.detail))
    return await _api_error(request, err)


ERROR_HANDLERS = {
    APIError: _api_error,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
}


def create_app(config: ServerConfig, worker: Optional[Worker] = None, metrics: Optional[Metrics] = None) -> FastAPI:
    """The app; the worker (models load on its thread) starts with the app's lifespan."""
    metrics = metrics or (worker.metrics if worker is not None else Metrics())
    if worker is None:
        worker = _make_worker(config, metrics)
    name = config.model_name or model_name_for(config.model)
    server = ServerState(
        config=config,
        worker=worker,
        metrics=metrics,
        responses=ResponseStore(config.responses_max_entries, config.responses_max_bytes),
        names=[name] + [n for n in config.served_model_names if n and n != name],
        created=int(time.time()),
    )

    app = FastAPI(
        title="dflash2-mlx",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=_lifespan,
        exception_handlers=ERROR_HANDLERS,
    )
    app.state.server = server
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config
    app.state.responses = server.responses
    for router in (admin.router, openai_routes.router, responses_routes.router, anthropic_routes.router):
        app.include_router(router)

    app.add_middleware(_Middleware, metrics=metrics, max_body=config.max_body_bytes)
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        origins = list(config.allowed_origins)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["x-request-id"],
            allow_credentials="*" not in origins,
        )
    return app
