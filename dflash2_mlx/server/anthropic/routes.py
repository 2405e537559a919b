"""Anthropic's routes: /v1/messages and /v1/messages/count_tokens, keyed by ``x-api-key``.

The request conversion and the response shape live in ``anthropic.api``. Errors come in
Anthropic's shape (the app's error handlers pick it by path).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from dflash2_mlx.server.anthropic.api import MessagesFormatter
from dflash2_mlx.server.anthropic.api import prepare as prepare_messages
from dflash2_mlx.server.chat import OutputParser, Prompt, render_chat
from dflash2_mlx.server.dependencies import ServerState, anthropic_key, read_json, server_state, validate
from dflash2_mlx.server.params import GenParams
from dflash2_mlx.server.schemas import MessagesRequest
from dflash2_mlx.server.stream import Accumulator

router = APIRouter(dependencies=[Depends(anthropic_key)])


async def _anthropic_prompt(request: Request, server: ServerState) -> tuple[MessagesRequest, list, GenParams, Prompt]:
    """The checked request, its tools, its sampling parameters and its rendered prompt."""
    req = validate(MessagesRequest, await read_json(request))
    server.check_model(req.model)
    server.require_ready()
    worker = server.worker
    messages, tools, kwargs, params = prepare_messages(req, worker, server.default_max_tokens())
    prompt = await asyncio.to_thread(
        render_chat, worker.tokenizer, messages, tools, kwargs, worker.prefix_cache is not None
    )
    return req, tools, params, prompt


@router.post("/v1/messages")
async def messages(request: Request, server: ServerState = Depends(server_state)):
    req, tools, params, prompt = await _anthropic_prompt(request, server)
    server.context_check(prompt.ids, "messages")
    tokenizer = server.worker.tokenizer
    parser = OutputParser(tokenizer, prompt.initial_state, tools, forced_tool_calls=params.forces_tool_calls)
    acc = Accumulator(tokenizer, len(prompt.ids), parser, tuple(params.stop))
    fmt = MessagesFormatter(acc, req.model)
    return server.respond(request, server.make_job(request, prompt.ids, params, prompt.save_at), fmt, req.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, server: ServerState = Depends(server_state)):
    _, _, _, prompt = await _anthropic_prompt(request, server)
    return {"input_tokens": len(prompt.ids)}
