"""The FastAPI app: routes, authentication, limits and error shapes, on top of one ``Worker``."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse

from dflash2_mlx.server.anthropic_api import MessagesFormatter
from dflash2_mlx.server.anthropic_api import prepare as prepare_messages
from dflash2_mlx.server.chat import OutputParser, render_chat
from dflash2_mlx.server.errors import APIError, bad_request, context_overflow, describe_validation_error, error_body
from dflash2_mlx.server.metrics import Metrics
from dflash2_mlx.server.openai_api import ChatFormatter, CompletionFormatter, prepare_chat, prepare_completion
from dflash2_mlx.server.responses_api import ResponsesFormatter, ResponsesRequest, renamed, translate
from dflash2_mlx.server.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, ResponseStore
from dflash2_mlx.server.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest, ModelCard, ModelList
from dflash2_mlx.server.stream import Accumulator, JobResponse
from dflash2_mlx.server.worker import Job, Worker

log = logging.getLogger("dflash2_mlx.server")

MAX_BODY_BYTES = 4 * 2**20
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


FALLBACK_MAX_TOKENS = 4096  # a request's max_tokens when neither it, the server nor the model sets one


@dataclass
class ServerConfig:
    model: str
    draft_model: Optional[str] = None
    api_key: Optional[str] = None
    allowed_origins: Sequence[str] = ()
    max_queue: int = 64
    max_concurrent: int = 4
    batch_verify: str = "auto"  # batch the active requests' verify passes: auto (measured), on, off
    max_context: Optional[int] = None
    served_model_names: Sequence[str] = ()
    prefix_cache_gb: float = 2.0
    prompt_cache_dir: Optional[str] = None  # prefix snapshots on disk (the CLI's default: disk_cache.default_dir())
    prompt_cache_gb: float = 8.0
    request_timeout: float = 600.0
    default_max_tokens: Optional[int] = None  # None: generation_config.json's max_new_tokens, else 4096
    max_body_bytes: int = MAX_BODY_BYTES
    model_name: Optional[str] = None  # shown in /v1/models; default: repo id or directory name
    responses_max_entries: int = DEFAULT_MAX_ENTRIES  # stored /v1/responses (previous_response_id), LRU
    responses_max_bytes: int = DEFAULT_MAX_BYTES


def model_name_for(model: str) -> str:
    """The name a model is served under: its repo id, or its directory's name (as loading.Target.name)."""
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model


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


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request) -> dict:
    body = await request.body()
    if not body.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(obj).__name__}")
    return obj


def validate(model_cls, obj: dict):
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        raise describe_validation_error(e.errors(include_url=False)) from None
    except RecursionError:
        raise bad_request("the request is nested too deeply") from None


def create_app(config: ServerConfig, worker: Optional[Worker] = None, metrics: Optional[Metrics] = None) -> FastAPI:
    """The app; the worker (models load on its thread) starts with the app's lifespan."""
    metrics = metrics or (worker.metrics if worker is not None else Metrics())
    if worker is None:
        worker = Worker(
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
        )
    name = config.model_name or model_name_for(config.model)
    names = [name] + [n for n in config.served_model_names if n and n != name]
    accepted = set(names) | {config.model}
    created = int(time.time())
    responses = ResponseStore(config.responses_max_entries, config.responses_max_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
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

    app = FastAPI(title="dflash2-mlx", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config
    app.state.responses = responses

    # ---- error shapes --------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc, request.url.path), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return await _api_error(request, describe_validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = APIError(
                404,
                f"no route {request.method} {request.url.path}; the API is under /v1 "
                "(chat/completions, completions, responses, messages, models)",
                code="not_found",
            )
        elif exc.status_code == 405:
            err = APIError(
                405, f"method {request.method} is not allowed on {request.url.path}", code="method_not_allowed"
            )
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return await _api_error(request, err)

    # ---- helpers -------------------------------------------------------------------------------

    def authorize(request: Request, anthropic: bool = False, either: bool = False) -> None:
        """The key from ``x-api-key`` (Anthropic routes, and ``either`` routes shared by both kinds of
        client) or from ``Authorization: Bearer``."""
        if not config.api_key:
            return
        given = None
        auth = request.headers.get("authorization", "")
        if anthropic or either:
            given = request.headers.get("x-api-key")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), config.api_key.encode()):
            where = (
                "the x-api-key header"
                if anthropic
                else "an 'Authorization: Bearer KEY' or 'x-api-key: KEY' header"
                if either
                else "an 'Authorization: Bearer KEY' header"
            )
            raise APIError(
                401,
                f"{'wrong' if given else 'missing'} API key: send the server's --api-key in {where}",
                code="invalid_api_key",
            )

    def check_model(model: str) -> str:
        if model not in accepted:
            raise APIError(
                404,
                f"model '{model[:200]}' is not served here; available: {names}",
                code="model_not_found",
                param="model",
            )
        return model

    def require_ready() -> None:
        if worker.state == "loading":
            raise APIError(
                503,
                "the model is still loading; retry in a few seconds",
                code="model_loading",
                headers={"Retry-After": "5"},
            )
        if worker.state != "ready":
            raise APIError(
                503,
                "the server is shutting down"
                if worker.state == "stopping"
                else f"the model failed to load: {worker.error}",
                code="unavailable",
            )

    def default_max_tokens() -> int:
        """max_tokens of a request that gives none: --default-max-tokens, else the model's own."""
        if config.default_max_tokens is not None:
            return config.default_max_tokens
        return int(worker.defaults.get("max_new_tokens", FALLBACK_MAX_TOKENS))

    def context_check(ids: list[int], param: str) -> None:
        if worker.max_context and len(ids) >= worker.max_context:
            raise context_overflow(len(ids), worker.max_context, param)

    def make_job(request: Request, ids, params, save_at) -> Job:
        return Job(
            id=request.scope["state"]["request_id"],
            prompt=ids,
            params=params,
            save_at=save_at,
            loop=asyncio.get_running_loop(),
            deadline=time.monotonic() + config.request_timeout,
        )

    def respond(request, job, formatter, stream: bool) -> JobResponse:
        worker.submit(job)
        return JobResponse(job, worker, formatter, stream, request.url.path)

    # ---- routes --------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        body = {
            "status": {"ready": "ok"}.get(worker.state, worker.state),
            "model": name,
            "queue_depth": worker.queue_depth(),
            "active": worker.active_requests(),
            "busy": worker.busy(),
        }
        if worker.error:
            body["error"] = worker.error
        return JSONResponse(body, status_code=200 if worker.state == "ready" else 503)

    @app.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request, either=True)
        return ModelList(data=[ModelCard(id=n, created=created) for n in names]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        authorize(request, either=True)
        if model_id not in accepted:
            raise APIError(
                404,
                f"model '{model_id[:200]}' is not served here; available: {names}",
                code="model_not_found",
                param="model",
            )
        return ModelCard(id=model_id, created=created).model_dump()

    async def chat_job(
        request: Request, req: ChatCompletionRequest, param: str = "messages"
    ) -> tuple[Job, Accumulator]:
        """A chat request's job and the accumulator that parses its output (shared by the chat
        and the Responses routes)."""
        messages, tools, kwargs, params = prepare_chat(req, worker, default_max_tokens())
        prompt = await asyncio.to_thread(
            render_chat, worker.tokenizer, messages, tools, kwargs, worker.prefix_cache is not None
        )
        context_check(prompt.ids, param)
        parser = OutputParser(worker.tokenizer, prompt.initial_state, tools, forced_tool_calls=params.forces_tool_calls)
        acc = Accumulator(worker.tokenizer, len(prompt.ids), parser, tuple(params.stop), params.top_logprobs)
        return make_job(request, prompt.ids, params, prompt.save_at), acc

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = validate(ChatCompletionRequest, await read_json(request))
        check_model(req.model)
        require_ready()
        job, acc = await chat_job(request, req)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatFormatter(acc, req.model, include_usage, job.params.logprobs)
        return respond(request, job, fmt, req.stream)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        authorize(request)
        req = validate(ResponsesRequest, await read_json(request))
        check_model(req.model)
        turn = translate(req, responses)
        require_ready()
        try:
            job, acc = await chat_job(request, validate(ChatCompletionRequest, turn.chat), "input")
        except APIError as e:
            raise renamed(e) from None
        fmt = ResponsesFormatter(acc, req, turn, job.params.max_tokens, responses if req.store is not False else None)
        return respond(request, job, fmt, req.stream)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        authorize(request)
        stored = responses.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"no stored response '{response_id[:100]}' (kept in memory, bounded, until the server restarts)",
                code="not_found",
                param="response_id",
            )
        return stored

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        authorize(request)
        if not responses.delete(response_id):
            raise APIError(404, f"no stored response '{response_id[:100]}'", code="not_found", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        raise APIError(
            404,
            "this server does not serve embeddings: it runs one generative model (chat, completions, "
            "responses, messages); use an embedding model server for /v1/embeddings",
            code="embeddings_not_supported",
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = validate(CompletionRequest, await read_json(request))
        check_model(req.model)
        require_ready()
        ids, params = await asyncio.to_thread(prepare_completion, req, worker, default_max_tokens())
        context_check(ids, "prompt")
        acc = Accumulator(worker.tokenizer, len(ids), None, tuple(params.stop), params.top_logprobs)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = CompletionFormatter(acc, req.model, include_usage, params.logprobs)
        return respond(request, make_job(request, ids, params, []), fmt, req.stream)

    async def _anthropic_prompt(request: Request):
        authorize(request, anthropic=True)
        req = validate(MessagesRequest, await read_json(request))
        check_model(req.model)
        require_ready()
        messages, tools, kwargs, params = prepare_messages(req, worker, default_max_tokens())
        prompt = await asyncio.to_thread(
            render_chat, worker.tokenizer, messages, tools, kwargs, worker.prefix_cache is not None
        )
        return req, tools, params, prompt

    @app.post("/v1/messages")
    async def messages(request: Request):
        req, tools, params, prompt = await _anthropic_prompt(request)
        context_check(prompt.ids, "messages")
        parser = OutputParser(worker.tokenizer, prompt.initial_state, tools, forced_tool_calls=params.forces_tool_calls)
        acc = Accumulator(worker.tokenizer, len(prompt.ids), parser, tuple(params.stop))
        fmt = MessagesFormatter(acc, req.model)
        return respond(request, make_job(request, prompt.ids, params, prompt.save_at), fmt, req.stream)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        _, _, _, prompt = await _anthropic_prompt(request)
        return {"input_tokens": len(prompt.ids)}

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
