"""One request's life after it is queued: waiting, streaming or collecting, and ending cleanly.

``JobResponse`` is an ASGI response that listens for the client's disconnect the whole time (while
queued, during prefill and while streaming) and cancels the job at once, so the worker stops within
one cycle. It also enforces the request timeout: a request still waiting when it expires gets a
503; one already generating is cut short and ends normally with ``finish_reason: "length"``.
Errors before the worker starts the job are HTTP errors; after a stream has started they are sent
as an error event, then the stream ends.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
from typing import Any, Optional

from starlette.responses import Response

from dflash2_mlx.server.chat import Delta, OutputParser
from dflash2_mlx.server.errors import APIError, error_bytes
from dflash2_mlx.server.worker import Job, Worker

log = logging.getLogger("dflash2_mlx.server")
KEEPALIVE_SECONDS = 10.0


class Accumulator:
    """The output of one job so far: tokens, raw text, parsed deltas, logprobs and statistics."""

    def __init__(
        self,
        tokenizer,
        prompt_tokens: int,
        parser: Optional[OutputParser] = None,
        stops: tuple = (),
        top_logprobs: int = 0,
    ):
        self.tokenizer, self.parser = tokenizer, parser
        self.prompt_tokens = prompt_tokens
        self.stops = stops
        self.top_logprobs = top_logprobs
        self.tokens: list[int] = []
        self.text = ""
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict] = []
        self.logprobs: list = []
        self.stats = None
        self.engine_finish: Optional[str] = None
        self.cancelled = False

    def add(self, event) -> list[Delta]:
        self.tokens += event.tokens
        self.text += event.text
        if getattr(event, "logprobs", None):
            self.logprobs += event.logprobs
        if event.stats is not None:
            self.stats = event.stats
        if event.finish_reason:
            self.engine_finish = event.finish_reason
        if self.parser is not None:
            deltas = self.parser.feed(event.text)
            if event.finish_reason:
                deltas += self.parser.finish()
        else:
            deltas = [Delta("content", event.text)] if event.text else []
        return self._keep(deltas)

    def _keep(self, deltas: list[Delta]) -> list[Delta]:
        for d in deltas:
            if d.kind == "content":
                self.content += d.text
            elif d.kind == "reasoning":
                self.reasoning += d.text
            else:
                self.tool_calls.append(d.tool_call)
        return deltas

    def close(self) -> list[Delta]:
        """Called when the job ended without a final event (cancelled)."""
        self.cancelled = True
        if self.parser is None:
            return []
        deltas = self.parser.finish()
        return self._keep(deltas)

    @property
    def finish_reason(self) -> str:
        reason = self.engine_finish or "length"
        if reason not in ("stop", "length"):
            reason = "length"  # cancelled (timeout or shutdown): the answer was cut short
        if reason == "stop" and self.tool_calls:
            return "tool_calls"
        return reason

    @property
    def stopped_by_eos(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] in self.tokenizer.eos_token_ids

    def matched_stop(self) -> Optional[str]:
        """Which stop string ended the text (None for an end-of-sequence token or the length)."""
        if self.engine_finish != "stop" or self.stopped_by_eos or not self.stops:
            return None
        try:
            full = self.tokenizer.decode(self.tokens)
        except Exception:
            return self.stops[0]
        rest = full[len(self.text) :] if full.startswith(self.text) else full
        hits = [(rest.find(s), s) for s in self.stops if s and rest.find(s) >= 0]
        return min(hits)[1] if hits else self.stops[0]

    def speculative(self) -> dict:
        s = self.stats
        if s is None:
            return {"acceptance_length": 1.0, "verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
        return {
            "acceptance_length": round(float(s.acceptance_length), 4),
            "verify_steps": s.verify_steps,
            "draft_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens,
            "by_source": getattr(s, "by_source", None),
            "controller": getattr(s, "controller", None),
        }

    def usage(self) -> dict:
        completion = self.stats.generation_tokens if self.stats is not None else len(self.tokens)
        cached = (getattr(self.stats, "cached_tokens", 0) or 0) if self.stats is not None else 0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])


class Formatter(abc.ABC):
    """How one API shapes a job's output; ``acc`` is the job's Accumulator."""

    acc: Accumulator

    def start(self) -> list[bytes]:
        return []

    def event(self, event, deltas: list[Delta]) -> list[bytes]:
        return []

    def end(self, deltas: list[Delta]) -> list[bytes]:
        return []

    def error(self, err: APIError) -> list[bytes]:
        return [
            sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}),
            b"data: [DONE]\n\n",
        ]

    @abc.abstractmethod
    def body(self) -> dict:
        """The non-streaming response body, in the API's own shape."""


def sse(obj: Any, event: Optional[str] = None) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


class JobResponse(Response):
    def __init__(self, job: Job, worker: Worker, formatter: Formatter, stream: bool, path: str):
        self.job, self.worker, self.formatter, self.stream, self.path = job, worker, formatter, stream, path
        self.disconnected = False
        self.timed_out = False
        self.started_stream = False
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        listener = asyncio.create_task(self._listen(receive))
        metrics = self.worker.metrics
        with metrics.lock:
            metrics.in_flight += 1
        try:
            if self.stream:
                await self._run_stream(send)
            else:
                await self._run_complete(send)
        finally:
            listener.cancel()
            with metrics.lock:
                metrics.in_flight -= 1
            if self.job.state != "done":
                self._abandon("client")

    # ---- waiting -------------------------------------------------------------------------------

    async def _listen(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                self._abandon("client")
                return

    def _abandon(self, why: str) -> None:
        """Stop the job: take it out of the queue if it is waiting, cancel it if it runs."""
        if self.worker.withdraw(self.job):
            self.job.why_cancelled = why
            self.job.queue.put_nowait(("end", None))
        else:
            self.job.stop(why)

    async def _next(self) -> tuple[str, Any]:
        """The job's next item; ("keepalive", None) after a quiet interval."""
        while True:
            now = time.monotonic()
            if not self.timed_out and now >= self.job.deadline:
                self.timed_out = True
                if self.worker.withdraw(self.job):
                    self.job.why_cancelled = "timeout"
                    self.job.queue.put_nowait(("end", None))
                    return "error", APIError(
                        503,
                        "the request timed out while waiting in the queue; retry later",
                        code="queue_timeout",
                        headers={"Retry-After": "10"},
                    )
                self.job.stop("timeout")
            wait = KEEPALIVE_SECONDS if self.timed_out else min(KEEPALIVE_SECONDS, max(0.01, self.job.deadline - now))
            try:
                return await asyncio.wait_for(self.job.queue.get(), wait)
            except asyncio.TimeoutError:
                if self.timed_out or time.monotonic() < self.job.deadline:
                    return "keepalive", None

    # ---- answering -----------------------------------------------------------------------------

    async def _send(self, send, message: dict) -> bool:
        if self.disconnected:
            return False
        try:
            await send(message)
            return True
        except OSError:  # the client went away mid-write
            self.disconnected = True
            self._abandon("client")
            return False

    async def _send_json(self, send, status: int, body: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        raw += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
        if await self._send(send, {"type": "http.response.start", "status": status, "headers": raw}):
            await self._send(send, {"type": "http.response.body", "body": data})

    async def _send_error(self, send, err: APIError) -> None:
        await self._send_json(send, err.status, json.loads(error_bytes(err, self.path)), err.headers)

    async def _run_complete(self, send) -> None:
        acc, error = self.formatter.acc, None
        while not self.disconnected:
            kind, payload = await self._next()
            if kind == "event":
                acc.add(payload)
            elif kind == "cancelled":
                acc.close()
            elif kind == "error":
                error = error or payload
            elif kind == "end":
                break
        if self.disconnected:
            return
        if error is None and self.job.why_cancelled == "shutdown" and acc.engine_finish is None and not acc.tokens:
            error = APIError(503, "the server is shutting down", code="shutting_down")
        if error is not None:
            await self._send_error(send, error)
            return
        if acc.engine_finish is None:
            acc.close()
        await self._send_json(send, 200, self.formatter.body())

    async def _run_stream(self, send) -> None:
        fmt, acc = self.formatter, self.formatter.acc
        # Until the worker takes the job, failures are plain HTTP errors.
        while not self.disconnected:
            kind, payload = await self._next()
            if kind == "keepalive":
                continue
            if kind == "error":
                await self._send_error(send, payload)
                return
            if kind == "end":  # cancelled before it started
                if self.job.why_cancelled == "shutdown":
                    await self._send_error(send, APIError(503, "the server is shutting down", code="shutting_down"))
                return
            break  # "start"
        if self.disconnected:
            return
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        if not await self._send(send, {"type": "http.response.start", "status": 200, "headers": headers}):
            return
        self.started_stream = True
        if not await self._chunks(send, fmt.start()):
            return
        finished = False
        while not self.disconnected:
            kind, payload = await self._next()
            if kind == "keepalive":
                ok = await self._chunks(send, [b": keepalive\n\n"])
            elif kind == "event":
                deltas = acc.add(payload)
                ok = await self._chunks(send, fmt.event(payload, deltas))
            elif kind == "cancelled":
                ok = True
                acc.close()
            elif kind == "error":
                finished = True
                ok = await self._chunks(send, fmt.error(payload))
            else:  # end
                if not finished:
                    deltas = acc.close() if acc.engine_finish is None else []
                    await self._chunks(send, fmt.end(deltas))
                break
            if not ok:
                return
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def _chunks(self, send, chunks: list[bytes]) -> bool:
        for chunk in chunks:
            if not await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True}):
                return False
        return True
