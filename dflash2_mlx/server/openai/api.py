"""`/v1/chat/completions` and `/v1/completions`: requests -> jobs, jobs -> OpenAI-shaped output."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Optional

from dflash2_mlx.server.chat import Delta, openai_messages, openai_tools, template_kwargs
from dflash2_mlx.server.errors import bad_request
from dflash2_mlx.server.params import build_params, check_max_tokens
from dflash2_mlx.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    NamedToolChoice,
    ResponseFunction,
    ResponseToolCall,
    Speculative,
    Usage,
)
from dflash2_mlx.server.stream import Accumulator, Formatter, sse
from dflash2_mlx.server.structured import structured_output

log = logging.getLogger("dflash2_mlx.server")


# ---- request -> prompt + params ----------------------------------------------------------------


def prepare_chat(req: ChatCompletionRequest, worker, default_max_tokens: int):
    """(prompt, params, tools) for a chat request; every problem a 400 naming the field."""
    refuse_legacy_functions(req)
    max_tokens = (
        check_max_tokens(req.max_completion_tokens, None, "max_completion_tokens")
        if req.max_completion_tokens is not None
        else check_max_tokens(req.max_tokens, default_max_tokens)
    )
    constraint = structured_output(
        req.response_format.model_dump(exclude_none=True) if req.response_format is not None else None,
        [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice,
        req.parallel_tool_calls,
    )
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    params = build_params(
        req,
        max_tokens=max_tokens,
        vocab_size=worker.vocab_size,
        defaults=worker.defaults,
        logprobs=bool(req.logprobs),
        top_logprobs=top,
        constraint=constraint,
    )
    messages = openai_messages(req.messages)
    tools = openai_tools(req.tools, req.tool_choice)
    kwargs = template_kwargs(req.chat_template_kwargs)
    return messages, tools, kwargs, params


def refuse_legacy_functions(req: ChatCompletionRequest) -> None:
    """The deprecated ``functions`` / ``function_call`` fields get a 400 saying what replaces them
    (answering them as ``tool_calls`` would leave a legacy client reading an empty function_call)."""
    hint = 'send tools=[{"type": "function", "function": {...}}] and tool_choice instead'
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise bad_request(
                f"'{name}' is the deprecated form of tools / tool_choice and is not supported: {hint}", name
            )
    for i, m in enumerate(req.messages):
        if m.function_call is not None:
            raise bad_request(
                f"messages[{i}].function_call is the deprecated form of tool_calls and is not supported: "
                'send tool_calls=[{"id": ..., "type": "function", "function": {...}}]',
                f"messages[{i}].function_call",
            )


def prepare_completion(req: CompletionRequest, worker, default_max_tokens: int):
    from dflash2_mlx.text.stops import encode_prompt

    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of not in (None, 1):
        raise bad_request(f"best_of must be 1 (got {req.best_of})", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request(f"logprobs must be in 0..20, got {req.logprobs}", "logprobs")
    max_tokens = check_max_tokens(req.max_tokens, default_max_tokens)
    params = build_params(
        req,
        max_tokens=max_tokens,
        vocab_size=worker.vocab_size,
        defaults=worker.defaults,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
    )
    prompt = req.prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        if isinstance(prompt[0], list):  # [[ids]]
            if len(prompt) != 1:
                raise bad_request("one prompt per request: send the prompts as separate requests", "prompt")
            prompt = prompt[0]
        elif isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise bad_request("one prompt per request: send the prompts as separate requests", "prompt")
            prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        ids = encode_prompt(worker.tokenizer, prompt, use_chat_template=False)
    else:
        ids = list(prompt)
        if not ids:
            raise bad_request("prompt is empty", "prompt")
        bad = next((t for t in ids if not 0 <= t < worker.vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt token id {bad} is outside the vocabulary (0..{worker.vocab_size - 1})", "prompt")
    return ids, params


# ---- output ------------------------------------------------------------------------------------


def _token_entry(acc: Accumulator, token: int, logprob: float) -> dict:
    text = acc.token_text(token)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(acc: Accumulator, items: list) -> Optional[dict]:
    if not items:
        return None
    content = []
    for token, (lp, top) in items:
        entry = _token_entry(acc, token, lp)
        entry["top_logprobs"] = [_token_entry(acc, t, l) for t, l in top[: acc.top_logprobs]]
        content.append(entry)
    return {"content": content}


def completion_logprobs(acc: Accumulator, items: list, offset: int) -> Optional[dict]:
    if not items:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for token, (lp, top) in items:
        text = acc.token_text(token)
        tokens.append(text)
        lps.append(float(lp))
        tops.append({acc.token_text(t): float(l) for t, l in top[: acc.top_logprobs]} if acc.top_logprobs else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _event_logprobs(acc: Accumulator, event) -> list:
    lps = getattr(event, "logprobs", None)
    return list(zip(event.tokens, lps)) if lps else []


class ChatFormatter(Formatter):
    def __init__(self, acc: Accumulator, model: str, include_usage: bool = False, want_logprobs: bool = False):
        self.acc, self.model, self.include_usage, self.want_logprobs = acc, model, include_usage, want_logprobs
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tool_index = 0

    def _chunk(self, delta: dict, finish=None, logprobs=None, **extra) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                **extra,
            }
        )

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _delta(self, d: Delta) -> dict:
        if d.kind == "content":
            return {"content": d.text}
        if d.kind == "reasoning":
            return {"reasoning_content": d.text}
        call = d.tool_call
        out = {
            "tool_calls": [
                {
                    "index": self.tool_index,
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ]
        }
        self.tool_index += 1
        return out

    def event(self, event, deltas: list[Delta]) -> list[bytes]:
        lp = chat_logprobs(self.acc, _event_logprobs(self.acc, event)) if self.want_logprobs else None
        out = []
        for d in deltas:
            out.append(self._chunk(self._delta(d), logprobs=lp))
            lp = None
        if lp is not None:
            out.append(self._chunk({}, logprobs=lp))
        return out

    def end(self, deltas: list[Delta]) -> list[bytes]:
        out = [self._chunk(self._delta(d)) for d in deltas]
        spec = self.acc.speculative()
        out.append(self._chunk({}, finish=self.acc.finish_reason, speculative=spec))
        if self.include_usage:
            out.append(
                sse(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self.acc.usage(),
                        "speculative": spec,
                    }
                )
            )
        out.append(b"data: [DONE]\n\n")
        return out

    def body(self) -> dict:
        acc = self.acc
        calls = [
            ResponseToolCall(id=c["id"], function=ResponseFunction(name=c["name"], arguments=c["arguments"]))
            for c in acc.tool_calls
        ] or None
        message = AssistantMessage(
            content=acc.content if (acc.content or not calls) else None,
            reasoning_content=acc.reasoning or None,
            tool_calls=calls,
        )
        lp = chat_logprobs(acc, list(zip(acc.tokens, acc.logprobs))) if self.want_logprobs else None
        out = ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChatChoice(message=message, logprobs=lp, finish_reason=acc.finish_reason)],
            usage=Usage(**acc.usage()),
            speculative=Speculative(**acc.speculative()),
        ).model_dump(exclude_none=True)
        out["choices"][0]["message"].setdefault("content", None)
        out["choices"][0].setdefault("logprobs", None)
        return out


class CompletionFormatter(Formatter):
    def __init__(self, acc: Accumulator, model: str, include_usage: bool = False, want_logprobs: bool = False):
        self.acc, self.model, self.include_usage, self.want_logprobs = acc, model, include_usage, want_logprobs
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offset = 0

    def _chunk(self, text: str, finish=None, logprobs=None, **extra) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                **extra,
            }
        )

    def event(self, event, deltas: list[Delta]) -> list[bytes]:
        text = "".join(d.text for d in deltas)
        lp = (
            completion_logprobs(self.acc, _event_logprobs(self.acc, event), self.offset) if self.want_logprobs else None
        )
        self.offset += len(text)
        return [self._chunk(text, logprobs=lp)] if text or lp else []

    def end(self, deltas: list[Delta]) -> list[bytes]:
        spec = self.acc.speculative()
        out = [self._chunk("".join(d.text for d in deltas), finish=self.acc.finish_reason, speculative=spec)]
        if self.include_usage:
            out.append(
                sse(
                    {
                        "id": self.id,
                        "object": "text_completion",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self.acc.usage(),
                        "speculative": spec,
                    }
                )
            )
        out.append(b"data: [DONE]\n\n")
        return out

    def body(self) -> dict:
        acc = self.acc
        lp = completion_logprobs(acc, list(zip(acc.tokens, acc.logprobs)), 0) if self.want_logprobs else None
        out = Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(text=acc.content, logprobs=lp, finish_reason=acc.finish_reason)],
            usage=Usage(**acc.usage()),
            speculative=Speculative(**acc.speculative()),
        ).model_dump(exclude_none=True)
        out["choices"][0].setdefault("logprobs", None)
        return out
