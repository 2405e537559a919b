"""`/v1/messages` (Anthropic Messages API): requests -> template messages, output -> content blocks
and Anthropic's stream events."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional

from dflash2_mlx.server.chat import Delta
from dflash2_mlx.server.errors import bad_request
from dflash2_mlx.server.markup import partial_arguments
from dflash2_mlx.server.params import build_params, check_max_tokens
from dflash2_mlx.server.schemas import MessagesRequest
from dflash2_mlx.server.stream import Accumulator, Formatter, sse
from dflash2_mlx.server.structured import anthropic_tool_choice_constraint, response_format_constraint


def _block_text(content, param: str) -> str:
    """The text of a tool_result's content (a string or text blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{param}[{j}] must be a text block: this server takes text only", f"{param}[{j}]")
        pieces.append(block["text"])
    return "".join(pieces)


def convert(req: MessagesRequest) -> tuple[list[dict], Optional[list[dict]], dict]:
    """(template messages, tools, template kwargs) for an Anthropic request."""
    messages: list[dict] = []
    if req.system:
        if isinstance(req.system, str):
            system = req.system
        else:
            for j, b in enumerate(req.system):
                if b.type != "text" or b.text is None:
                    raise bad_request(f"system[{j}] must be a text block", f"system[{j}]")
            system = "".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        param = f"messages[{i}].content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        text, reasoning, calls, results = [], [], [], []
        for j, b in enumerate(m.content):
            where = f"{param}[{j}]"
            if b.type == "text":
                if b.text is None:
                    raise bad_request(f"{where} is a text block without 'text'", f"{where}.text")
                text.append(b.text)
            elif b.type == "thinking" and m.role == "assistant":
                reasoning.append(b.thinking or "")
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise bad_request(f"{where} (tool_use) has no name", f"{where}.name")
                calls.append(
                    {
                        "id": b.id or f"toolu_{j}",
                        "type": "function",
                        "function": {"name": b.name, "arguments": b.input or {}},
                    }
                )
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise bad_request(f"{where} (tool_result) has no tool_use_id", f"{where}.tool_use_id")
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.tool_use_id,
                        "content": _block_text(b.content, f"{where}.content"),
                    }
                )
            else:
                raise bad_request(
                    f"{where} has type '{b.type}', which a {m.role} message cannot carry here "
                    "(this server takes text, thinking, tool_use and tool_result blocks)",
                    f"{where}.type",
                )
        messages += results
        if m.role == "assistant":
            d: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                d["tool_calls"] = calls
            if reasoning:
                d["reasoning_content"] = "".join(reasoning)
            messages.append(d)
        elif text or not results:
            messages.append({"role": "user", "content": "".join(text)})
    tools = None
    choice = req.tool_choice
    if req.tools and not (choice is not None and choice.type == "none"):
        names = [t.name for t in req.tools]
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise bad_request(f"tool_choice names '{choice.name}', which is not among the tools {names}", "tool_choice")
        tools = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema or {"type": "object", "properties": {}},
                    }.items()
                    if v is not None
                },
            }
            for t in req.tools
        ]
    elif choice is not None and choice.type in ("any", "tool"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    kwargs: dict = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    return messages, tools, kwargs


def output_constraint(req: MessagesRequest, tools: Optional[list[dict]]):
    """Forced tool use (``tool_choice`` any / tool) or ``output_config.format`` (a JSON schema)."""
    forced = anthropic_tool_choice_constraint(tools, req.tool_choice) if tools else None
    fmt, param = (req.output_config or {}).get("format"), "output_config.format"
    if fmt is None and req.output_format is not None:
        fmt, param = req.output_format, "output_format"
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"):
        raise bad_request(f'{param} must be {{"type": "json_schema", "schema": {{...}}}}', param)
    return forced or response_format_constraint(fmt, param)


def prepare(req: MessagesRequest, worker, default_max_tokens: int):
    max_tokens = check_max_tokens(req.max_tokens, default_max_tokens)
    messages, tools, kwargs = convert(req)
    params = build_params(
        req,
        max_tokens=max_tokens,
        vocab_size=worker.vocab_size,
        defaults=worker.defaults,
        stop=req.stop_sequences,
        constraint=output_constraint(req, tools),
    )
    return messages, tools, kwargs, params


class MessagesFormatter(Formatter):
    def __init__(self, acc: Accumulator, model: str):
        self.acc, self.model = acc, model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.index = -1
        self.open: Optional[str] = None  # type of the open content block

    # ---- streaming -----------------------------------------------------------------------------

    def start(self) -> list[bytes]:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.acc.prompt_tokens, "output_tokens": 0},
        }
        return [sse({"type": "message_start", "message": message}, "message_start"), sse({"type": "ping"}, "ping")]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _open(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [
            sse({"type": "content_block_start", "index": self.index, "content_block": block}, "content_block_start")
        ]

    def _delta(self, delta: dict) -> bytes:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def _stream(self, deltas: list[Delta]) -> list[bytes]:
        out = []
        for d in deltas:
            if d.kind == "tool_call":
                call = d.tool_call
                out += self._open({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["name"], "input": {}})
                if call["arguments"]:  # a call cut off before its arguments began has none to send
                    out.append(self._delta({"type": "input_json_delta", "partial_json": call["arguments"]}))
                out += self._close()
            elif d.kind == "reasoning":
                if self.open != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": d.text}))
            else:
                if self.open != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d.text}))
        return out

    def event(self, event, deltas: list[Delta]) -> list[bytes]:
        return self._stream(deltas)

    def end(self, deltas: list[Delta]) -> list[bytes]:
        out = self._stream(deltas) + self._close()
        reason, seq = self.stop_reason()
        spec = self.acc.speculative()
        usage = self.usage()
        out.append(
            sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": {"output_tokens": usage["output_tokens"]},
                    "speculative": spec,
                },
                "message_delta",
            )
        )
        out.append(sse({"type": "message_stop", "speculative": spec}, "message_stop"))
        return out

    def error(self, err) -> list[bytes]:
        from dflash2_mlx.server.errors import anthropic_body

        return [sse(anthropic_body(err), "error")]

    # ---- complete ------------------------------------------------------------------------------

    def stop_reason(self) -> tuple[str, Optional[str]]:
        acc = self.acc
        reason = acc.finish_reason
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        seq = acc.matched_stop()
        return ("stop_sequence", seq) if seq is not None else ("end_turn", None)

    def usage(self) -> dict:
        u = self.acc.usage()
        return {
            "input_tokens": u["prompt_tokens"],
            "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": u["prompt_tokens_details"]["cached_tokens"],
        }

    def body(self) -> dict:
        acc = self.acc
        content: list[dict] = []
        if acc.reasoning:
            content.append({"type": "thinking", "thinking": acc.reasoning, "signature": ""})
        if acc.content:
            content.append({"type": "text", "text": acc.content})
        for call in acc.tool_calls:
            try:
                args = json.loads(call["arguments"])
            except ValueError:  # cut off by max_tokens (or malformed): what a client streaming it would hold
                args = partial_arguments(call["arguments"])
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_id(call["id"]),
                    "name": call["name"],
                    "input": args if isinstance(args, dict) else {"value": args},
                }
            )
        reason, seq = self.stop_reason()
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": self.usage(),
            "speculative": acc.speculative(),
        }


def _tool_id(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")
