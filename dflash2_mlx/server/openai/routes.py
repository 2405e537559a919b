"""OpenAI's routes: /v1/chat/completions, /v1/completions, /v1/models, and a clear 404 for /v1/embeddings.

The request conversion and the response shapes live in ``openai.api``; these routes check, queue
and answer. Errors come in OpenAI's shape (the app's error handlers pick it by path).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from dflash2_mlx.server.chat import OutputParser, render_chat
from dflash2_mlx.server.dependencies import ServerState, either_key, openai_key, read_json, server_state, validate
from dflash2_mlx.server.errors import APIError
from dflash2_mlx.server.openai.api import ChatFormatter, CompletionFormatter, prepare_chat, prepare_completion
from dflash2_mlx.server.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from dflash2_mlx.server.stream import Accumulator
from dflash2_mlx.server.worker import Job

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(either_key)])
async def list_models(server: ServerState = Depends(server_state)):
    return ModelList(data=[ModelCard(id=n, created=server.created) for n in server.names]).model_dump()


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(either_key)])
async def get_model(model_id: str, server: ServerState = Depends(server_state)):
    if not server.is_served(model_id):
        raise server.model_not_found(model_id)
    return ModelCard(id=model_id, created=server.created).model_dump()


async def chat_job(
    request: Request, server: ServerState, req: ChatCompletionRequest, param: str = "messages"
) -> tuple[Job, Accumulator]:
    """A chat request's job and the accumulator that parses its output (shared by the chat
    and the Responses routes); ``param`` names the request field a too-long prompt came from."""
    worker = server.worker
    messages, tools, kwargs, params = prepare_chat(req, worker, server.default_max_tokens())
    prompt = await asyncio.to_thread(
        render_chat, worker.tokenizer, messages, tools, kwargs, worker.prefix_cache is not None
    )
    server.context_check(prompt.ids, param)
    parser = OutputParser(worker.tokenizer, prompt.initial_state, tools, forced_tool_calls=params.forces_tool_calls)
    acc = Accumulator(worker.tokenizer, len(prompt.ids), parser, tuple(params.stop), params.top_logprobs)
    return server.make_job(request, prompt.ids, params, prompt.save_at), acc


@router.post("/v1/chat/completions", dependencies=[Depends(openai_key)])
async def chat_completions(request: Request, server: ServerState = Depends(server_state)):
    req = validate(ChatCompletionRequest, await read_json(request))
    server.check_model(req.model)
    server.require_ready()
    job, acc = await chat_job(request, server, req)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt = ChatFormatter(acc, req.model, include_usage, job.params.logprobs)
    return server.respond(request, job, fmt, req.stream)


@router.post("/v1/completions", dependencies=[Depends(openai_key)])
async def completions(request: Request, server: ServerState = Depends(server_state)):
    req = validate(CompletionRequest, await read_json(request))
    server.check_model(req.model)
    server.require_ready()
    worker = server.worker
    ids, params = await asyncio.to_thread(prepare_completion, req, worker, server.default_max_tokens())
    server.context_check(ids, "prompt")
    acc = Accumulator(worker.tokenizer, len(ids), None, tuple(params.stop), params.top_logprobs)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt = CompletionFormatter(acc, req.model, include_usage, params.logprobs)
    return server.respond(request, server.make_job(request, ids, params, []), fmt, req.stream)


@router.post("/v1/embeddings")
async def embeddings():
    # no key check: the answer is the same for everyone and reveals nothing
    raise APIError(
        404,
        "this server does not serve embeddings: it runs one generative model (chat, completions, "
        "responses, messages); use an embedding model server for /v1/embeddings",
        code="embeddings_not_supported",
    )
