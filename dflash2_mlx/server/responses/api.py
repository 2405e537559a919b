"""`/v1/responses` (OpenAI Responses API) requests: the request model, its checks, and its
translation into a chat request.

A Responses request is turned into the equivalent chat-completions request (input items ->
messages, ``text.format`` -> ``response_format``, flat function tools -> chat tools), so prompt
rendering, sampling parameters, constraints, job submission and output parsing are the chat
route's own. Fields this server cannot honour are refused with a 400 that names them.
The output side (Response objects and stream events) is ``responses.output``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from pydantic import ConfigDict, Field

from dflash2_mlx.server.errors import APIError, bad_request
from dflash2_mlx.server.responses.store import ChainBroken, ResponseStore
from dflash2_mlx.server.schemas import _Strict

# Fields of the OpenAI spec that change nothing here when they have these values.
NO_OP_VALUES = {
    "background": (False,),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "prompt_cache_retention": ("in_memory",),
}
# dflash2-mlx extensions, passed to the chat request as they are (the chat route checks them).
EXTENSIONS = (
    "seed",
    "top_k",
    "min_p",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "chat_template_kwargs",
)
INCLUDABLE = {"reasoning.encrypted_content", "message.output_text.logprobs"}
LOGPROBS = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class ResponsesRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[Dict[str, Any]] = None
    reasoning: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    stream: bool = False
    stream_options: Optional[Dict[str, Any]] = None
    include: Optional[List[str]] = None
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    top_logprobs: Optional[int] = None


@dataclass
class Turn:
    """One Responses request, translated."""

    chat: dict  # a ChatCompletionRequest body
    input_items: list[dict]  # this request's own input items, as stored for later turns
    tools: list[dict] = field(default_factory=list)  # as echoed in the Response
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    summary: bool = False  # reasoning goes into the reasoning item's summary, not its content
    encrypted_reasoning: bool = False
    logprobs: bool = False  # output_text parts and deltas carry logprobs


# ---- request -> chat request -------------------------------------------------------------------


def check_fields(req: ResponsesRequest) -> None:
    """A 400 naming the first field set to something this server does not do."""
    extra = dict(req.model_extra or {})
    for name, value in extra.items():
        if name in EXTENSIONS or value is None:
            continue
        if name in NO_OP_VALUES:
            if any(value == v and type(value) is type(v) for v in NO_OP_VALUES[name]):
                continue
            allowed = " or ".join(json.dumps(v) for v in NO_OP_VALUES[name])
            raise bad_request(f"{name}={json.dumps(value)[:80]} is not supported by this server (only {allowed})", name)
        raise bad_request(
            f"the field '{name}' is not supported by this server's /v1/responses; remove it "
            "(docs/server.md lists the supported fields)",
            name,
        )
    for name in req.include or []:
        if name not in INCLUDABLE:
            raise bad_request(f"include '{name}' is not supported (supported: {sorted(INCLUDABLE)})", "include")
    if req.stream_options and set(req.stream_options) - {"include_obfuscation"}:
        bad = sorted(set(req.stream_options) - {"include_obfuscation"})[0]
        raise bad_request(f"stream_options.{bad} is not supported", f"stream_options.{bad}")
    if req.reasoning:
        for key in set(req.reasoning) - {"effort", "summary", "generate_summary"}:
            raise bad_request(f"reasoning.{key} is not supported", f"reasoning.{key}")


def translate(req: ResponsesRequest, store: ResponseStore) -> Turn:
    """The chat request for a Responses request (every problem a 400 naming the Responses field)."""
    check_fields(req)
    history: list[dict] = []
    if req.previous_response_id is not None:
        try:
            history = store.conversation(req.previous_response_id)
        except ChainBroken as e:
            missing = e.args[0]
            which = "is" if missing == req.previous_response_id else f"continues '{missing}', which is"
            raise bad_request(
                f"previous response '{req.previous_response_id[:100]}' {which} not stored here "
                "(responses are kept in memory, bounded, until the server restarts; store: false "
                "responses are never kept): send the whole conversation as input instead",
                "previous_response_id",
                code="previous_response_not_found",
            ) from None
    items = [{"role": "user", "content": req.input, "type": "message"}] if isinstance(req.input, str) else req.input
    if isinstance(req.input, str) and not req.input:
        raise bad_request("input is empty", "input")
    messages = to_messages(history, "previous_response_id") if history else []
    messages += to_messages(items, "input")
    if req.instructions:
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": req.instructions + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise bad_request("input has no items", "input")
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    for name in EXTENSIONS:
        if (req.model_extra or {}).get(name) is not None:
            chat[name] = req.model_extra[name]
    turn = Turn(chat=chat, input_items=list(items))
    if LOGPROBS in (req.include or []) or (req.top_logprobs or 0) > 0:
        turn.logprobs = True
        chat.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    _tools(req, turn)
    _text_format(req, turn)
    _reasoning(req, turn)
    return turn


def _tools(req: ResponsesRequest, turn: Turn) -> None:
    chat_tools = []
    for i, tool in enumerate(req.tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{i}] has type {json.dumps(kind)[:40]}: this server runs function tools only", f"tools[{i}].type"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}] (function) needs a 'name'", f"tools[{i}].name")
        unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise bad_request(f"tools[{i}].{unknown[0]} is not supported", f"tools[{i}].{unknown[0]}")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": function})
        turn.tools.append(
            {
                "type": "function",
                "name": name,
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
            }
        )
    if chat_tools:
        turn.chat["tools"] = chat_tools
    choice = req.tool_choice
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice[:40]!r}", "tool_choice"
            )
        turn.chat["tool_choice"] = choice
    elif choice.get("type") == "function" and isinstance(choice.get("name"), str):
        turn.chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request(
            f"tool_choice {json.dumps(choice)[:80]} is not supported: use 'none', 'auto', 'required' "
            'or {"type": "function", "name": ...}',
            "tool_choice",
        )


def _text_format(req: ResponsesRequest, turn: Turn) -> None:
    text = dict(req.text or {})
    verbosity = text.pop("verbosity", None)
    if verbosity not in (None, "medium"):
        raise bad_request(f"text.verbosity {verbosity!r} is not supported (only 'medium')", "text.verbosity")
    fmt = text.pop("format", None)
    if text:
        raise bad_request(f"text.{sorted(text)[0]} is not supported", f"text.{sorted(text)[0]}")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format.type")
    turn.text_format = fmt
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format (json_schema) needs a 'schema' object", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        spec.setdefault("name", "response")
        turn.chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt["type"] == "json_object":
        turn.chat["response_format"] = {"type": "json_object"}


def _reasoning(req: ResponsesRequest, turn: Turn) -> None:
    reasoning = req.reasoning or {}
    effort = reasoning.get("effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad_request(
            f"reasoning.effort {effort!r} is not one of none, minimal, low, medium, high, xhigh", "reasoning.effort"
        )
    if effort in ("none", "minimal"):  # the model thinks or it does not: no budget in between
        kwargs = dict(turn.chat.get("chat_template_kwargs") or {})
        kwargs.setdefault("enable_thinking", False)
        turn.chat["chat_template_kwargs"] = kwargs
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary not in (None, "auto", "concise", "detailed"):
        raise bad_request(f"reasoning.summary {summary!r} is not one of auto, concise, detailed", "reasoning.summary")
    turn.summary = summary is not None
    turn.encrypted_reasoning = "reasoning.encrypted_content" in (req.include or [])


def to_messages(items: list, param: str) -> list[dict]:
    """Responses input items (and stored output items) -> chat messages. Consecutive assistant-side
    items (reasoning, message, function calls) make one assistant turn."""
    messages: list[dict] = []
    assistant: Optional[dict] = None  # the assistant turn being built

    def open_assistant() -> dict:
        nonlocal assistant
        if assistant is None:
            assistant = {"role": "assistant", "content": ""}
            messages.append(assistant)
        return assistant

    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (a message or an item)", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role must be user, system, developer or assistant, got {role!r}", f"{where}.role"
                )
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                turn = open_assistant()
                turn["content"] += text
            else:
                assistant = None
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where} (function_call) needs a string '{key}'", f"{where}.{key}")
            open_assistant().setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where} (function_call_output) needs a string 'call_id'", f"{where}.call_id")
            assistant = None
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text(parts, f"{where}.content") if parts else (item.get("encrypted_content") or "")
            turn = open_assistant()
            turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        else:
            raise bad_request(
                f"{where} has type {json.dumps(kind)[:40]}: this server takes message, function_call, "
                "function_call_output and reasoning items",
                f"{where}.type",
            )
    return messages


def _text(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param)
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            pieces.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind in TEXT_PARTS:
            raise bad_request(f"{param}[{j}] is a text part without 'text'", f"{param}[{j}].text")
        else:
            raise bad_request(
                f"{param}[{j}] has type {json.dumps(kind)[:40]}: this server takes text only "
                "(no images, audio or files)",
                f"{param}[{j}].type",
            )
    return "".join(pieces)


CHAT_TO_RESPONSES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("messages", "input"),
)


def renamed(err: APIError) -> APIError:
    """An error of the chat route, in the Responses request's field names (the context-overflow
    sentence keeps OpenAI's exact words, which clients match on)."""
    for chat_name, name in CHAT_TO_RESPONSES:
        if err.code != "context_length_exceeded":
            err.message = err.message.replace(chat_name, name)
        if err.param and err.param.startswith(chat_name):
            err.param = name + err.param[len(chat_name) :]
    return err
