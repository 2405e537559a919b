"""What every route shares: the server's state, the API-key checks, and reading a request body.

A route gets the state with ``Depends(server_state)`` and names its key check among its route
dependencies, so FastAPI runs the check before the route reads the body. The checks that need the
body (the model name) or must follow it (readiness) are ``ServerState`` methods the route calls in
this order: key, body, model, readiness. Clients see the first failing one.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request
from pydantic import BaseModel, ValidationError

from dflash2_mlx.server.config import FALLBACK_MAX_TOKENS, ServerConfig
from dflash2_mlx.server.errors import APIError, bad_request, context_overflow, describe_validation_error
from dflash2_mlx.server.metrics import Metrics
from dflash2_mlx.server.params import GenParams
from dflash2_mlx.server.responses.store import ResponseStore
from dflash2_mlx.server.stream import Formatter, JobResponse
from dflash2_mlx.server.worker import Job, Worker


@dataclass
class ServerState:
    """One app's worker, settings and stores, and the checks and job plumbing its routes share."""

    config: ServerConfig
    worker: Worker
    metrics: Metrics
    responses: ResponseStore  # stored /v1/responses, for previous_response_id and GET/DELETE
    names: list[str]  # the names /v1/models lists: the model's own first, then the aliases
    created: int  # the models' `created` timestamp: when the app was made

    def is_served(self, model: str) -> bool:
        """A request may name the model by any listed name or by the path or repo id it was loaded from."""
        return model in self.names or model == self.config.model

    def model_not_found(self, model: str) -> APIError:
        return APIError(
            404,
            f"model '{model[:200]}' is not served here; available: {self.names}",
            code="model_not_found",
            param="model",
        )

    def check_model(self, model: str) -> str:
        if not self.is_served(model):
            raise self.model_not_found(model)
        return model

    def require_ready(self) -> None:
        """503 while the models load, after a failed load and during shutdown."""
        worker = self.worker
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

    def default_max_tokens(self) -> int:
        """max_tokens of a request that gives none: --default-max-tokens, else the model's own."""
        if self.config.default_max_tokens is not None:
            return self.config.default_max_tokens
        return int(self.worker.defaults.get("max_new_tokens", FALLBACK_MAX_TOKENS))

    def context_check(self, ids: list[int], param: str) -> None:
        if self.worker.max_context and len(ids) >= self.worker.max_context:
            raise context_overflow(len(ids), self.worker.max_context, param)

    def make_job(self, request: Request, ids: list[int], params: GenParams, save_at: list[int]) -> Job:
        """A job for the worker, under the request's id, with the server's request timeout."""
        return Job(
            id=request.scope["state"]["request_id"],
            prompt=ids,
            params=params,
            save_at=save_at,
            loop=asyncio.get_running_loop(),
            deadline=time.monotonic() + self.config.request_timeout,
            client=client_key(request),
        )

    def respond(self, request: Request, job: Job, formatter: Formatter, stream: bool) -> JobResponse:
        """Queue the job and answer with its stream or, once it is done, its whole response."""
        self.worker.submit(job)
        return JobResponse(job, self.worker, formatter, stream, request.url.path)


async def server_state(request: Request) -> ServerState:
    """The state of the app serving this request (``Depends(server_state)``)."""
    return request.app.state.server


# ---- API keys ----------------------------------------------------------------------------------


def authorize(request: Request, api_key: Optional[str], anthropic: bool = False, either: bool = False) -> None:
    """The key from ``x-api-key`` (Anthropic routes, and ``either`` routes shared by both kinds of
    client) or from ``Authorization: Bearer``; no check when the server has no key."""
    if not api_key:
        return
    given = request.headers.get("x-api-key") if anthropic or either else None
    if given is None:
        given = _bearer(request)
    if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
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


def client_key(request: Request) -> str:
    """Who is asking, for what must stay theirs (the copy drafts' index of earlier answers): a
    digest of the key the request presents (``x-api-key`` or a Bearer token, checked or not),
    "" for none. Clients of a keyless server that send different tokens stay apart too."""
    given = request.headers.get("x-api-key") or _bearer(request)
    return hashlib.sha256(given.encode()).hexdigest() if given else ""


def _bearer(request: Request) -> Optional[str]:
    """The token of an ``Authorization: Bearer`` header, or None."""
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


# The route dependencies are async: FastAPI would run a plain `def` one on its thread pool.


async def openai_key(request: Request) -> None:
    """The OpenAI routes' key check: ``Authorization: Bearer KEY``."""
    authorize(request, request.app.state.server.config.api_key)


async def anthropic_key(request: Request) -> None:
    """The Anthropic routes' key check: ``x-api-key: KEY`` (a Bearer header is accepted too)."""
    authorize(request, request.app.state.server.config.api_key, anthropic=True)


async def either_key(request: Request) -> None:
    """The key check of routes both kinds of client call (/v1/models): either header."""
    authorize(request, request.app.state.server.config.api_key, either=True)


# ---- request bodies ----------------------------------------------------------------------------


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request) -> dict:
    """The body as a JSON object, or a 400 that says what is wrong with it (NaN and Infinity are not JSON)."""
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


def validate(model_cls: type[BaseModel], obj: dict) -> Any:
    """``obj`` as a ``model_cls`` request, or a 400 naming the first field that is wrong."""
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        raise describe_validation_error(e.errors(include_url=False)) from None
    except RecursionError:
        raise bad_request("the request is nested too deeply") from None
