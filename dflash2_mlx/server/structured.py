"""Structured output requests -> one ``OutputConstraint`` on ``GenParams`` -> the engine's grammar.

Routes call these on the event loop; each problem is a 400 (``errors.bad_request``) naming the
request field and, for a schema, the keyword the engine cannot enforce. Nothing is silently ignored.

- ``response_format_constraint(fmt, param)``: an OpenAI ``response_format`` (chat completions:
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``) or a Responses API
  ``text.format`` (the same fields flattened: ``{"type": "json_schema", "name", "schema",
  "strict"}``); ``{"type": "json_object"}``; ``{"type": "text"}`` or None -> None.
- ``tool_choice_constraint(tools, tool_choice, parallel_tool_calls, param)``: forced tool calls.
  ``tools`` are dicts in the chat shape (``{"type": "function", "function": {"name",
  "parameters"}}``) or the Responses shape (``{"type": "function", "name", "parameters"}``);
  ``tool_choice`` is ``"required"``, ``{"type": "function", "function": {"name": ...}}`` or
  ``{"type": "function", "name": ...}``; ``"auto"``, ``"none"`` and None force nothing (-> None).
  ``parallel_tool_calls`` false: exactly one call; true or None: one or more.
- ``anthropic_tool_choice_constraint(tools, tool_choice)``: Anthropic ``tool_choice`` ``any`` /
  ``tool`` (``disable_parallel_tool_use`` honoured); tools already in the chat shape.
- ``structured_output(...)``: the one constraint of a request: a forced tool call wins over a
  response format (the answer is then a tool call, not content).

Use: ``build_params(..., constraint=structured_output(...))`` puts it on ``GenParams.constraint``;
the worker thread turns it into the engine's grammar (``params.to_settings`` ->
``OutputConstraint.grammar``, starting after a reasoning block the prompt opens). A route that
renders tools passes ``forced_tool_calls=params.forces_tool_calls`` to ``chat.OutputParser`` so
the forced calls come back as tool calls whatever the model's template knows.

Forced tool calls use the model's tool-call markers when mlx-lm knows them for a JSON tool format
(``json_tools``) and Qwen's ``<tool_call>`` / ``</tool_call>`` text otherwise; the output is
``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`` (calls separated by a newline),
which the server's tool-call parsing turns into ``tool_calls`` / ``tool_use`` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dflash2_mlx.server.errors import bad_request

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ForcedTool:
    name: str
    parameters: dict  # its JSON Schema


@dataclass(frozen=True)
class OutputConstraint:
    """What the output must be. ``kind``: "json_object", "json_schema" or "tool_calls"."""

    kind: str
    schema: Optional[dict] = None  # json_schema
    name: Optional[str] = None  # json_schema's name (informational)
    strict: bool = False  # json_schema: objects take no unlisted properties
    tools: tuple[ForcedTool, ...] = field(default=())  # tool_calls: one of these per call
    parallel: bool = True  # tool_calls: one or more calls (False: exactly one)

    @property
    def forces_tool_calls(self) -> bool:
        return self.kind == "tool_calls"

    def grammar(self, tokenizer, stop_token_ids: Sequence[int], reasoning_end: Sequence[int] = ()):
        """The engine grammar (``dflash2_mlx.constraints.grammar.Grammar``) for this constraint and the
        model's tokenizer (worker thread). ``reasoning_end``: the prompt opened a reasoning block
        that these tokens close; the constraint starts after it."""
        from dflash2_mlx.constraints.grammar import Grammar, json_object_rules, json_schema_rules

        if self.kind == "json_object":
            rules = json_object_rules()
        elif self.kind == "json_schema":
            rules = json_schema_rules(self.schema, self.strict)
        else:
            rules = tool_call_rules(self, tokenizer)
        return Grammar(rules, tokenizer, stop_token_ids, reasoning_end)


# ---- response_format / text.format ------------------------------------------------------------


def response_format_constraint(fmt: Optional[dict], param: str = "response_format") -> Optional[OutputConstraint]:
    """An OpenAI ``response_format`` or Responses ``text.format`` dict -> constraint (None: plain text)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f'{param} must be an object like {{"type": "json_schema", ...}}', param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return OutputConstraint("json_object")
    if kind != "json_schema":
        raise bad_request(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{param}.type")
    nested = "json_schema" in fmt
    spec = fmt.get("json_schema") if nested else fmt
    where = f"{param}.json_schema" if nested else param
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with 'name' and 'schema'", where)
    schema = spec.get("schema")
    if schema is None:
        raise bad_request(f"{where}.schema is missing: give the JSON Schema the answer must follow", f"{where}.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be true or false", f"{where}.strict")
    check_schema(schema, f"{where}.schema", bool(strict))
    return OutputConstraint("json_schema", schema=schema, name=spec.get("name"), strict=bool(strict))


def check_schema(schema: Any, param: str, strict: bool = False) -> None:
    """400 naming the keyword when the engine cannot enforce ``schema``."""
    from dflash2_mlx.constraints.grammar import GrammarError, json_schema_rules

    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param)
    try:
        json_schema_rules(schema, strict)
    except GrammarError as e:
        raise bad_request(
            f"{param}: {e}", param, code="unsupported_schema" if e.keyword else "invalid_schema"
        ) from None


# ---- tool_choice ------------------------------------------------------------------------------


def _tool_fields(tool: Any, i: int, param: str) -> tuple[str, dict]:
    if not isinstance(tool, dict):
        raise bad_request(f"{param}[{i}] must be an object", f"{param}[{i}]")
    spec = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{param}[{i}] has no function name", f"{param}[{i}]")
    parameters = spec.get("parameters") or spec.get("input_schema") or EMPTY_PARAMETERS
    return name, parameters


def tool_choice_constraint(
    tools: Optional[list],
    tool_choice: Any,
    parallel_tool_calls: Optional[bool] = None,
    param: str = "tool_choice",
    tools_param: str = "tools",
) -> Optional[OutputConstraint]:
    """Forced tool calls for ``tool_choice`` "required" or a named function (None: nothing forced)."""
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise bad_request(f"{param} forces a tool call but the request has no tools", param)
    named = [_tool_fields(t, i, tools_param) for i, t in enumerate(tools)]
    if tool_choice == "required":
        chosen = named
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function") if isinstance(tool_choice.get("function"), dict) else tool_choice
        want = fn.get("name")
        chosen = [(n, p) for n, p in named if n == want]
        if not chosen:
            raise bad_request(f"{param} names '{want}', which is not among the tools {[n for n, _ in named]}", param)
        chosen = chosen[:1]
    else:
        raise bad_request(f"{param} must be 'auto', 'none', 'required' or {{\"type\": \"function\", ...}}", param)
    forced = []
    for name, parameters in chosen:
        index = [n for n, _ in named].index(name)
        check_schema(parameters, f"{tools_param}[{index}].parameters")
        forced.append(ForcedTool(name, parameters))
    return OutputConstraint("tool_calls", tools=tuple(forced), parallel=parallel_tool_calls is not False)


def anthropic_tool_choice_constraint(tools: Optional[list], tool_choice: Any) -> Optional[OutputConstraint]:
    """Anthropic ``tool_choice`` (``{"type": "any"|"tool"|"auto"|"none", "name",
    "disable_parallel_tool_use"}``, a dict or a model with those attributes), tools in the chat shape."""
    if tool_choice is None:
        return None
    get = tool_choice.get if isinstance(tool_choice, dict) else lambda k: getattr(tool_choice, k, None)
    kind = get("type")
    parallel = not get("disable_parallel_tool_use")
    if kind == "any":
        return tool_choice_constraint(tools, "required", parallel)
    if kind == "tool":
        return tool_choice_constraint(tools, {"type": "function", "name": get("name")}, parallel)
    return None


def structured_output(
    response_format: Optional[dict] = None,
    tools: Optional[list] = None,
    tool_choice: Any = None,
    parallel_tool_calls: Optional[bool] = None,
    *,
    format_param: str = "response_format",
    tool_choice_param: str = "tool_choice",
) -> Optional[OutputConstraint]:
    """The request's one constraint: forced tool calls if any, else the response format's."""
    fmt = response_format_constraint(response_format, format_param)
    forced = tool_choice_constraint(tools, tool_choice, parallel_tool_calls, tool_choice_param)
    return forced or fmt


# ---- the tool-call grammar --------------------------------------------------------------------


def tool_call_markers(tokenizer) -> tuple[str, str]:
    """The model's tool-call start/end markers when it writes JSON tool calls, else Qwen's."""
    if getattr(tokenizer, "has_tool_calling", False):
        parser_module = getattr(tokenizer.tool_parser, "__module__", "") or ""
        if parser_module.endswith("json_tools") and tokenizer.tool_call_start and tokenizer.tool_call_end:
            return tokenizer.tool_call_start, tokenizer.tool_call_end
    return TOOL_CALL_START, TOOL_CALL_END


def _lark_literal(text: str, tokenizer) -> str:
    """A Lark terminal for ``text``: the token itself when it is one special token of the vocabulary."""
    from dflash2_mlx.constraints.grammar import hf_tokenizer

    added = getattr(hf_tokenizer(tokenizer), "added_tokens_encoder", {}) or {}
    if text in added:
        return f"<[{added[text]}]>"
    return json.dumps(text)


def tool_call_rules(constraint: OutputConstraint, tokenizer) -> str:
    """Lark rules (``answer``) for ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one, or one
    or more separated by newlines), the arguments following the chosen tool's parameters schema."""
    from dflash2_mlx.constraints.grammar import JSON_OPTIONS
    from dflash2_mlx.server.argument_bounds import bounded_numbers

    start, end = tool_call_markers(tokenizer)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": bounded_numbers(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in constraint.tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    many = ' ("\\n" call)*' if constraint.parallel else ""
    return (
        f"answer: call{many}\n"
        f'call: {_lark_literal(start, tokenizer)} "\\n" body "\\n" {_lark_literal(end, tokenizer)}\n'
        f"body: %json {json.dumps(schema)}\n"
    )
