"""`/v1/responses` output: a job's output as a Response object (its items, usage and status) or as
the Responses stream events, and the stored copy for ``previous_response_id``.

The request side (Responses request -> chat request) is ``responses.api``.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from dflash2_mlx.server.chat import Delta
from dflash2_mlx.server.errors import APIError
from dflash2_mlx.server.openai.api import chat_logprobs
from dflash2_mlx.server.responses.api import ResponsesRequest, Turn
from dflash2_mlx.server.responses.store import ResponseStore
from dflash2_mlx.server.stream import Accumulator, Formatter, sse


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormatter(Formatter):
    """A job's output as a Response object, or as the Responses stream events."""

    def __init__(
        self,
        acc: Accumulator,
        req: ResponsesRequest,
        turn: Turn,
        max_output_tokens: int,
        store: Optional[ResponseStore],
    ):
        self.acc, self.req, self.turn, self.store = acc, req, turn, store
        self.max_output_tokens = max_output_tokens
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict] = []
        self.open: Optional[dict] = None  # the message or reasoning item being streamed
        self.final: Optional[dict] = None

    # ---- the Response object -------------------------------------------------------------------

    def response(self, status: str, error: Optional[dict] = None) -> dict:
        req, acc = self.req, self.acc
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens or self.max_output_tokens,
            "metadata": req.metadata or {},
            "model": req.model,
            "output": list(self.output),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": (req.reasoning or {}).get("effort"),
                "summary": (req.reasoning or {}).get("summary"),
            },
            "service_tier": "default",
            "store": self.store is not None,
            "temperature": req.temperature,
            "text": {"format": self.turn.text_format, "verbosity": "medium"},
            "tool_choice": req.tool_choice or "auto",
            "tools": self.turn.tools,
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
        }
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
            out["usage"] = self.usage()
            out["speculative"] = acc.speculative()
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def usage(self) -> dict:
        u = self.acc.usage()
        reasoning = (
            len(self.acc.tokenizer.encode(self.acc.reasoning, add_special_tokens=False)) if self.acc.reasoning else 0
        )
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": min(reasoning, u["completion_tokens"])},
            "total_tokens": u["total_tokens"],
        }

    def _status(self) -> str:
        return "incomplete" if self.acc.finish_reason == "length" else "completed"

    def _finish(self) -> dict:
        self.final = self.response(self._status())
        if self.store is not None:
            self.store.put(self.final, self.turn.input_items)
        return self.final

    # ---- events --------------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body, kind)

    def _part_kind(self, item_type: str) -> str:
        if item_type == "message":
            return "output_text"
        return "summary_text" if self.turn.summary else "reasoning_text"

    def _open_item(self, item_type: str) -> list[bytes]:
        out = self._close_item("completed")
        index = len(self.output)
        if item_type == "message":
            item = {
                "id": _new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
        self.output.append(item)
        self.open = {"item": item, "index": index, "text": "", "logprobs": []}
        part = self._part(item_type, "")
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if item_type == "reasoning" and self.turn.summary:
            out.append(
                self._event(
                    "response.reasoning_summary_part.added",
                    item_id=item["id"],
                    output_index=index,
                    summary_index=0,
                    part=part,
                )
            )
        else:
            out.append(
                self._event(
                    "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        return out

    def _part(self, item_type: str, text: str, logprobs: Optional[list] = None) -> dict:
        kind = self._part_kind(item_type)
        part = {"type": kind, "text": text}
        if kind == "output_text":
            part.update(annotations=[], logprobs=logprobs or [])
        return part

    def _delta_event(self, text: str, logprobs: Optional[list] = None) -> bytes:
        item, index = self.open["item"], self.open["index"]
        self.open["text"] += text
        if item["type"] == "message":
            self.open["logprobs"] += logprobs or []
            return self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=logprobs or [],
            )
        if self.turn.summary:
            return self._event(
                "response.reasoning_summary_text.delta",
                item_id=item["id"],
                output_index=index,
                summary_index=0,
                delta=text,
            )
        return self._event(
            "response.reasoning_text.delta", item_id=item["id"], output_index=index, content_index=0, delta=text
        )

    def _close_item(self, status: str) -> list[bytes]:
        if self.open is None:
            return []
        item, index, text, logprobs = self.open["item"], self.open["index"], self.open["text"], self.open["logprobs"]
        self.open = None
        part = self._part(item["type"], text, logprobs)
        ids = {"item_id": item["id"], "output_index": index}
        item["status"] = status
        if item["type"] == "message":
            item["content"] = [part]
            out = [
                self._event("response.output_text.done", **ids, content_index=0, text=text, logprobs=logprobs),
                self._event("response.content_part.done", **ids, content_index=0, part=part),
            ]
        elif self.turn.summary:
            item["summary"] = [part]
            out = [
                self._event("response.reasoning_summary_text.done", **ids, summary_index=0, text=text),
                self._event("response.reasoning_summary_part.done", **ids, summary_index=0, part=part),
            ]
        else:
            item["content"] = [part]
            out = [
                self._event("response.reasoning_text.done", **ids, content_index=0, text=text),
                self._event("response.content_part.done", **ids, content_index=0, part=part),
            ]
        if item["type"] == "reasoning" and self.turn.encrypted_reasoning:
            item["encrypted_content"] = text  # not encrypted: this server keeps nothing secret from its client
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return out

    def _function_call(self, call: dict) -> list[bytes]:
        out = self._close_item("completed")
        index = len(self.output)
        item = {
            "id": _new_id("fc"),
            "type": "function_call",
            "call_id": call["id"],
            "name": call["name"],
            "arguments": "",
            "status": "in_progress",
        }
        self.output.append(item)
        ids = {"item_id": item["id"], "output_index": index}
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        out.append(self._event("response.function_call_arguments.delta", **ids, delta=call["arguments"]))
        out.append(
            self._event("response.function_call_arguments.done", **ids, arguments=call["arguments"], name=call["name"])
        )
        item.update(arguments=call["arguments"], status="completed" if call.get("complete", True) else "incomplete")
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return out

    def _logprobs(self, tokens: list, logprobs: list) -> list:
        entries = chat_logprobs(self.acc, list(zip(tokens, logprobs))) if self.turn.logprobs and logprobs else None
        return entries["content"] if entries else []

    def _stream(self, deltas: list[Delta], logprobs: Optional[list] = None) -> list[bytes]:
        """Events for parsed deltas; ``logprobs`` (of the engine event's tokens) go with the first
        text delta."""
        out: list[bytes] = []
        for d in deltas:
            if d.kind == "tool_call":
                out += self._function_call(d.tool_call)
                continue
            item_type = "message" if d.kind == "content" else "reasoning"
            if self.open is None or self.open["item"]["type"] != item_type:
                out += self._open_item(item_type)
            out.append(self._delta_event(d.text, logprobs if item_type == "message" else None))
            if item_type == "message":
                logprobs = None
        return out

    def start(self) -> list[bytes]:
        skeleton = self.response("in_progress")
        return [
            self._event("response.created", response=skeleton),
            self._event("response.in_progress", response=skeleton),
        ]

    def event(self, event, deltas: list[Delta]) -> list[bytes]:
        return self._stream(deltas, self._logprobs(event.tokens, getattr(event, "logprobs", None) or []))

    def end(self, deltas: list[Delta]) -> list[bytes]:
        out = self._stream(deltas)
        out += self._close_item(self._status())
        final = self._finish()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=final))
        return out

    def error(self, err: APIError) -> list[bytes]:
        failed = self.response("failed", error={"code": err.code or "server_error", "message": err.message})
        return [
            self._event("error", code=err.code, message=err.message, param=err.param),
            self._event("response.failed", response=failed),
        ]

    # ---- complete ------------------------------------------------------------------------------

    def body(self) -> dict:
        acc = self.acc
        self.output, self.open = [], None
        if acc.reasoning:
            self._open_item("reasoning")
            self._delta_event(acc.reasoning)
        status = self._status()
        if acc.content or not acc.tool_calls:
            self._open_item("message")
            self._delta_event(acc.content, self._logprobs(acc.tokens, acc.logprobs))
        self._close_item(status)
        for call in acc.tool_calls:
            self._function_call(call)
        return self._finish()
