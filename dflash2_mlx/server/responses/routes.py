"""OpenAI's Responses routes: create a response, and get or delete a stored one.

A Responses request is translated into a chat request (``responses.api.translate``, which also
resolves ``previous_response_id`` from the store) and runs as one; errors about the chat fields
are renamed to the Responses fields the client sent.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from dflash2_mlx.server.dependencies import ServerState, openai_key, read_json, server_state, validate
from dflash2_mlx.server.errors import APIError
from dflash2_mlx.server.openai.routes import chat_job
from dflash2_mlx.server.responses.api import ResponsesRequest, renamed, translate
from dflash2_mlx.server.responses.output import ResponsesFormatter
from dflash2_mlx.server.schemas import ChatCompletionRequest

router = APIRouter(dependencies=[Depends(openai_key)])


@router.post("/v1/responses")
async def create_response(request: Request, server: ServerState = Depends(server_state)):
    req = validate(ResponsesRequest, await read_json(request))
    server.check_model(req.model)
    turn = translate(req, server.responses)
    server.require_ready()
    try:
        job, acc = await chat_job(request, server, validate(ChatCompletionRequest, turn.chat), "input")
    except APIError as e:
        raise renamed(e) from None
    store = server.responses if req.store is not False else None
    fmt = ResponsesFormatter(acc, req, turn, job.params.max_tokens, store)
    return server.respond(request, job, fmt, req.stream)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, server: ServerState = Depends(server_state)):
    stored = server.responses.get(response_id)
    if stored is None:
        raise APIError(
            404,
            f"no stored response '{response_id[:100]}' (kept in memory, bounded, until the server restarts)",
            code="not_found",
            param="response_id",
        )
    return stored


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, server: ServerState = Depends(server_state)):
    if not server.responses.delete(response_id):
        raise APIError(404, f"no stored response '{response_id[:100]}'", code="not_found", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}
