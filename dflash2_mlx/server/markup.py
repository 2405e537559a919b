"""Template markup the answer must never show, and tool calls the token limit (or the model) left unfinished.

``OutputParser`` (``chat.py``) strips every string ``markup_strings`` lists from content and
reasoning, streamed or not. A tool call whose JSON body does not parse is read with
``unfinished_tool_call``: with its name readable it is still reported as a call (``complete``
false, ``arguments`` the JSON text written so far, or for Qwen3-Coder-style XML calls the object of
the parameters complete so far), otherwise it is dropped; either way its ``<tool_call>`` text never
reaches the content. ``partial_arguments`` turns such arguments into the
JSON object Anthropic's ``tool_use.input`` must be. docs/server.md "Truncated and malformed tool
calls" says what each API then reports.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable, Optional

log = logging.getLogger("dflash2_mlx.server")

# What a JSON tool call opens with ({"name": "NAME", "arguments": ...}): the forced grammar
# (structured.tool_call_rules) and mlx-lm's json_tools models write the name first.
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(.*)', re.DOTALL)
_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)
# Qwen3-Coder / Qwen3.5's XML calls: <function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...</function>
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_XML_PARAMETER_END, _XML_FUNCTION_END = "</parameter>", "\n</function>"


def markup_strings(tokenizer, extra: tuple[str, ...] = ()) -> list[str]:
    """Every piece of template markup the model can write as text: the tokenizer's special tokens
    (``<|im_start|>`` ...), its thinking and tool-call markers, mlx-lm's structural markers and
    ``extra`` (e.g. the forced-tool-call markers). Longest first, without duplicates."""
    from dflash2_mlx.constraints.grammar import hf_tokenizer

    hf = hf_tokenizer(tokenizer)
    found = set(getattr(hf, "all_special_tokens", None) or [])
    for added in (getattr(hf, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(added.content)
    for name in ("think_start", "think_end", "tool_call_start", "tool_call_end"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            found.add(value)
    found.update(getattr(tokenizer, "structural_markers", None) or ())
    found.update(extra)
    return sorted((s for s in found if s and s.strip()), key=lambda s: (-len(s), s))


def unfinished_tool_call(
    body: str, parse: Optional[Callable[[str], Optional[list]]] = None
) -> Optional[tuple[str, str]]:
    """(name, arguments text so far) of a tool call whose body does not parse (cut off by the token
    limit, or malformed), or None when not even its name can be read. JSON calls keep the JSON
    text written so far; XML calls (``<function=NAME>``) the JSON object of the parameters complete
    so far, read by ``parse`` (the model's tool parser: body -> calls, or None)."""
    m = _NAME.match(body)
    if m is None:
        return _unfinished_xml_call(body, parse)
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    rest = _ARGUMENTS.match(m.group(2))
    arguments = rest.group(1) if rest else ""  # cut off before its arguments began
    try:  # a complete arguments object followed by something broken: keep the object
        value, end = json.JSONDecoder().raw_decode(arguments)
        if isinstance(value, dict):
            arguments = arguments[:end]
    except ValueError:
        pass
    return name, arguments


def _unfinished_xml_call(body: str, parse: Optional[Callable[[str], Optional[list]]]) -> Optional[tuple[str, str]]:
    m = _XML_FUNCTION.match(body)
    if m is None:
        return None
    last = body.rfind(_XML_PARAMETER_END)
    complete = body[: last + len(_XML_PARAMETER_END)] if last >= m.end() else body[: m.end()]
    calls = parse(complete + _XML_FUNCTION_END) if parse is not None else None
    return m.group(1).strip(), calls[0]["arguments"] if calls else "{}"


def partial_arguments(arguments: str) -> dict[str, Any]:
    """The JSON object ``arguments`` holds so far: what is complete, read as Anthropic's SDK reads
    a streamed ``input_json_delta`` (jiter's partial mode: a string cut off is left out, a number
    keeps its digits so far). ``{}`` when nothing of an object can be read."""
    from pydantic_core import from_json

    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def log_dropped_call(body: str) -> None:
    log.warning("dropped a tool call whose name cannot be read (%d characters): %r", len(body), body[:120])
