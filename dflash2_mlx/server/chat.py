"""Prompts from chat messages, and the model's output split into content, reasoning and tool calls.

Rendering goes through the model's own chat template (mlx-lm's ``TokenizerWrapper``), with the
request's tools and ``chat_template_kwargs``. Message boundaries (for the prefix cache) come from
``dflash2_mlx.text.chat_template``, as in ``chat``.

The output side reuses mlx-lm's ``TextStateMachine`` (the markers of the model's thinking and
tool-call syntax, matched on text) and the tool parser mlx-lm picked for the tokenizer.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from dflash2_mlx.server.errors import APIError, bad_request
from dflash2_mlx.text.chat_template import message_boundaries
from dflash2_mlx.text.reasoning import initial_state

log = logging.getLogger("dflash2_mlx.server")

# Template arguments the server sets itself.
RESERVED_TEMPLATE_KWARGS = {
    "messages",
    "conversation",
    "tools",
    "documents",
    "add_generation_prompt",
    "tokenize",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "continue_final_message",
    "chat_template",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
}


# ---- requests -> template messages -------------------------------------------------------------


def openai_messages(messages) -> list[dict]:
    """Validated ``ChatMessage``s as plain dicts in the shape Hugging Face chat templates expect."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": _text_content(m.content, f"messages[{i}].content")}
        if m.role == "user" and not d["content"] and m.content is None:
            raise bad_request(f"messages[{i}] (user) has no content", f"messages[{i}].content")
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    f"messages[{i}]: only assistant messages carry tool_calls", f"messages[{i}].tool_calls"
                )
            d["tool_calls"] = [
                {
                    "id": tc.id or f"call_{j}",
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": _arguments(tc.function.arguments)},
                }
                for j, tc in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None and m.role == "assistant":
            d["reasoning_content"] = reasoning
        out.append(d)
    return out


def _text_content(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        if part.type in ("text", "input_text", "output_text"):
            if part.text is None:
                raise bad_request(f"{param}[{j}] is a text part without 'text'", f"{param}[{j}].text")
            pieces.append(part.text)
        else:
            raise bad_request(
                f"{param}[{j}] has type '{part.type}': this server takes text only (no images, audio or files)",
                f"{param}[{j}].type",
            )
    return "".join(pieces)


def _arguments(arguments) -> Any:
    """Tool-call arguments as templates want them: a dict when the JSON string parses to one."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


def openai_tools(tools, tool_choice) -> Optional[list[dict]]:
    """The tools to render, after ``tool_choice`` ("none" renders none; a named one must exist)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    if tool_choice == "none":
        return None
    if tool_choice is not None and not isinstance(tool_choice, str) and tool_choice.function.name not in names:
        raise bad_request(
            f"tool_choice names '{tool_choice.function.name}', which is not among the tools {names}", "tool_choice"
        )
    return [t.model_dump(exclude_none=True) for t in tools]


def template_kwargs(kwargs: Optional[dict]) -> dict:
    kwargs = dict(kwargs or {})
    bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {bad}: the server sets them", "chat_template_kwargs")
    return kwargs


# ---- rendering ---------------------------------------------------------------------------------


@dataclass
class Prompt:
    ids: list[int]
    save_at: list[int]
    initial_state: str = "normal"  # "reasoning" when the template opens a thinking block


def render_chat(
    tokenizer, messages: list[dict], tools: Optional[list], kwargs: dict, with_boundaries: bool = True
) -> Prompt:
    if not getattr(tokenizer, "has_chat_template", False):
        from mlx_lm.server import convert_chat

        ids = list(tokenizer.encode(convert_chat(messages)))
        return Prompt(ids, [], "normal")
    extra = dict(kwargs)
    if tools:
        extra["tools"] = tools
    ids = _apply(tokenizer, messages, True, extra)
    save_at = message_boundaries(tokenizer, messages, ids, **extra) if with_boundaries else []
    return Prompt(ids, save_at, initial_state(tokenizer, ids))


def _apply(tokenizer, messages, add_generation_prompt: bool, extra: dict) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra
        )
    except APIError:
        raise
    except Exception as e:  # jinja2 TemplateError (raise_exception in templates), TypeError, KeyError...
        detail = " ".join(str(e).split())[:300] or type(e).__name__
        raise bad_request(f"the model's chat template rejected these messages: {detail}", "messages") from None
    if isinstance(ids, dict):  # a BatchEncoding from some tokenizers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# ---- output parsing ----------------------------------------------------------------------------


@dataclass
class Delta:
    kind: str  # "content", "reasoning" or "tool_call"
    text: str = ""
    # {"id", "name", "arguments" (JSON text), "complete" (false: cut off or malformed, see markup.py)}
    tool_call: Optional[dict] = None


class OutputParser:
    """Splits streamed model text into content, reasoning and tool calls; template markup (special
    tokens, thinking and tool-call markers) never reaches content or reasoning (see ``markup.py``)."""

    def __init__(
        self,
        tokenizer,
        state: str = "normal",
        tools: Optional[list] = None,
        reasoning: bool = True,
        tool_calls: bool = True,
        forced_tool_calls: bool = False,
    ):
        """``forced_tool_calls``: the output is grammar-forced into tool calls
        (``structured.tool_call_markers``' format), parsed as such even when mlx-lm knows no tool
        format for this model. Tools the model calls by itself are parsed with mlx-lm's parser for
        the model, or as JSON between Qwen's markers when mlx-lm knows none."""
        from mlx_lm.generate import TextStateMachine

        from dflash2_mlx.server.markup import markup_strings
        from dflash2_mlx.server.structured import TOOL_CALL_END, TOOL_CALL_START, tool_call_markers

        self._sm_cls = TextStateMachine
        self.parse_tools = bool(tool_calls and tools)
        self.parse_reasoning = bool(reasoning and getattr(tokenizer, "has_thinking", False))
        self.forced = bool(forced_tool_calls and self.parse_tools)
        self.tools = tools
        if self.parse_tools and (forced_tool_calls or not getattr(tokenizer, "has_tool_calling", False)):
            from mlx_lm.tool_parsers.json_tools import parse_tool_call

            self.tool_parser = parse_tool_call
            self.tool_start, self.tool_end = tool_call_markers(tokenizer)
        else:
            self.tool_parser = tokenizer.tool_parser if self.parse_tools else None
            self.tool_start = tokenizer.tool_call_start if self.parse_tools else None
            self.tool_end = tokenizer.tool_call_end if self.parse_tools else None
        transitions: dict[str, list] = {}
        if self.parse_reasoning:
            transitions["normal"] = [(tokenizer.think_start, "reasoning")]
            transitions["reasoning"] = [(tokenizer.think_end, "normal")]
        if self.parse_tools:
            transitions.setdefault("normal", []).append((self.tool_start, "tool"))
            if self.parse_reasoning:
                transitions["reasoning"].append((self.tool_start, "tool"))
            transitions["tool"] = [(self.tool_end, "normal")] if self.tool_end else []
        # Every other piece of markup is a self-transition: matched (across chunk boundaries) and
        # dropped without changing state, as mlx-lm drops its stop words.
        markup = markup_strings(tokenizer, (TOOL_CALL_START, TOOL_CALL_END))
        self.markers = markup + [text for edges in transitions.values() for text, _ in edges]
        for name in ("normal", "reasoning", "tool") if self.parse_tools else ("normal", "reasoning"):
            edges = transitions.setdefault(name, [])
            taken = {text for text, _ in edges}
            edges += [(text, name) for text in markup if text not in taken]
        if state == "reasoning" and not self.parse_reasoning:
            state = "normal"
        self.sm = TextStateMachine(transitions)
        self.state = self.sm.make_state(state)
        self.current = state
        self.tool_text = ""
        self.tool_calls = 0
        self._strip = False  # drop the blank lines templates put after a closed thinking block

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        self.state, segments = self._sm_cls.split(self.state, text)
        return self._collect(segments)

    def finish(self) -> list[Delta]:
        """The held-back text (a partial marker) and an unterminated tool call, at the end."""
        self.state, rest, name = self._sm_cls.flush(self.state)
        out = self._collect([(name, self._without_cut_markup(rest))])
        if self.current == "tool" and self.tool_text:
            out += self._tool_delta(self.tool_text)
            self.tool_text = ""
        return out

    def _collect(self, segments) -> list[Delta]:
        out: list[Delta] = []
        for state, text in segments:
            if self.current == "tool" and state != "tool":
                out += self._tool_delta(self.tool_text)
                self.tool_text = ""
            if self.current == "reasoning" and state == "normal":
                self._strip = True
            self.current = state
            if state == "normal" and self._strip and text:
                text = text.lstrip()
                self._strip = not text
            if not text:
                continue
            if state == "reasoning":
                out.append(Delta("reasoning", text))
            elif state == "tool":
                self.tool_text += text
            elif not (self.forced and not text.strip()):  # forced calls: the grammar's separators
                out.append(Delta("content", text))
        return _merge(out)

    def _without_cut_markup(self, text: str) -> str:
        """``text`` without its longest end that begins some marker (markup the end cut off)."""
        for i in range(len(text)):
            if any(m.startswith(text[i:]) for m in self.markers):
                return text[:i]
        return text

    def _tool_delta(self, text: str) -> list[Delta]:
        """The calls in one tool-call body. A body that does not parse (cut off by the token limit,
        or malformed) is still a call when its name can be read (``complete`` false, ``arguments``
        the JSON text written so far), else it is dropped: its markup never becomes content."""
        from dflash2_mlx.server.markup import log_dropped_call, unfinished_tool_call

        calls = parse_tool_calls(self.tool_parser, text, self.tools)
        if calls is None:
            unfinished = unfinished_tool_call(text, lambda body: parse_tool_calls(self.tool_parser, body, self.tools))
            if unfinished is None:
                if text.strip():
                    log_dropped_call(text)
                return []
            name, arguments = unfinished
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": arguments, "complete": False}]
        self.tool_calls += len(calls)
        return [Delta("tool_call", tool_call=c) for c in calls]


def _merge(deltas: list[Delta]) -> list[Delta]:
    out: list[Delta] = []
    for d in deltas:
        if out and d.kind != "tool_call" and out[-1].kind == d.kind:
            out[-1] = Delta(d.kind, out[-1].text + d.text)
        else:
            out.append(d)
    return out


def parse_tool_calls(parser, text: str, tools: Optional[list]) -> Optional[list[dict]]:
    """Tool calls from the text between the markers, via the model's mlx-lm tool parser."""
    try:
        parsed = parser(text, tools)
    except Exception as e:  # parsers raise ValueError, JSONDecodeError, KeyError...
        log.warning("could not parse a tool call (%s: %s)", type(e).__name__, str(e)[:200])
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", {})
        calls.append(
            {
                "id": item.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "name": item["name"],
                "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                "complete": True,
            }
        )
    return calls
