"""Template markup never reaches an answer's text, unfinished tool calls stay calls (chat.OutputParser
with markup.py), and forced tool arguments have bounded numbers (argument_bounds.py, enforced by
llguidance)."""

from __future__ import annotations

import json

import pytest
import tiny
from server_helpers import qwen_style_checkpoint

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_checkpoints, tmp_path_factory):
    """A Qwen-style tokenizer: <think>/<tool_call> markers, <|im_start|> special tokens, mlx-lm's json_tools parser."""
    from mlx_lm.utils import load_tokenizer

    path = qwen_style_checkpoint(tiny_checkpoints[0], tmp_path_factory.mktemp("qwen") / "qwen-style")
    tok = load_tokenizer(path, eos_token_ids=[298])
    assert tok.has_tool_calling and tok.has_thinking
    return tok


class Event:
    def __init__(self, text, finish=None):
        self.tokens, self.text, self.stats, self.finish_reason, self.logprobs = [1], text, None, finish, None


def _run(tok, text: str, piece: int, state="normal", tools=TOOLS, finish="stop", forced=False):
    """The text through an Accumulator in pieces of ``piece`` characters (markers split across them)."""
    from dflash2_mlx.server.chat import OutputParser
    from dflash2_mlx.server.stream import Accumulator

    acc = Accumulator(tok, 1, OutputParser(tok, state, tools, forced_tool_calls=forced))
    for i in range(0, len(text), piece):
        acc.add(Event(text[i : i + piece], finish if i + piece >= len(text) else None))
    return acc


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 64])
def test_special_tokens_and_stray_markers_are_dropped_from_content_and_reasoning(qwen_tokenizer, piece):
    text = "Plan <|im_start|>it.</think>\n\nHello <|im_start|>world</tool_call>!<|im_end|><|endoftext|>"
    acc = _run(qwen_tokenizer, text, piece, state="reasoning")
    assert acc.reasoning == "Plan it." and acc.content == "Hello world!"


@pytest.mark.parametrize("piece", [1, 4, 64])
def test_a_tool_call_without_tools_in_the_request_loses_its_markers(qwen_tokenizer, piece):
    acc = _run(qwen_tokenizer, 'Sure.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', piece, tools=None)
    assert acc.tool_calls == [] and acc.content == 'Sure.\n{"name": "f", "arguments": {}}\n'


@pytest.mark.parametrize("piece", [1, 3, 64])
def test_a_call_the_model_writes_by_itself_and_the_limit_cuts_off_is_a_partial_call(qwen_tokenizer, piece):
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 12'
    acc = _run(qwen_tokenizer, text, piece, finish="length")
    assert acc.content == "Checking." and acc.finish_reason == "length"
    [call] = acc.tool_calls
    assert call["name"] == "get_weather" and call["complete"] is False
    assert call["arguments"] == '{"city": "Paris", "days": 12'


def test_markup_the_limit_cuts_off_is_not_left_at_the_end_of_the_text(qwen_tokenizer):
    acc = _run(qwen_tokenizer, "Hello <|im_st", 4, finish="length")
    assert acc.content == "Hello "
    acc = _run(
        qwen_tokenizer,
        'A<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_c',
        4,
        finish="length",
    )
    assert acc.content == "A" and json.loads(acc.tool_calls[0]["arguments"]) == {"city": "X"}


def test_a_malformed_call_with_a_readable_name_is_a_call_and_one_without_is_dropped(qwen_tokenizer):
    acc = _run(qwen_tokenizer, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}, }\n</tool_call>', 7)
    [call] = acc.tool_calls
    assert call["complete"] is False and call["arguments"] == '{"city": "X"}' and acc.content == ""
    assert acc.finish_reason == "tool_calls"
    acc = _run(qwen_tokenizer, "<tool_call>\nget_weather(city=X)\n</tool_call>Done.", 7)
    assert acc.tool_calls == [] and acc.content == "Done."


def test_an_xml_call_cut_off_keeps_its_name_and_the_parameters_complete_so_far():
    """Qwen3-Coder / Qwen3.5 write XML calls; their parameters are read by mlx-lm's own parser."""
    from mlx_lm.tool_parsers.qwen3_coder import parse_tool_call

    from dflash2_mlx.server.chat import parse_tool_calls
    from dflash2_mlx.server.markup import unfinished_tool_call

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    parse = lambda body: parse_tool_calls(parse_tool_call, body, tools)  # noqa: E731
    head = "\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
    assert unfinished_tool_call(head + "<parameter=city>\nPar", parse) == ("get_weather", '{"days": 3}')
    assert unfinished_tool_call("\n<function=get_weather>\n<param", parse) == ("get_weather", "{}")
    assert unfinished_tool_call("\n<function=get_wea", parse) is None


def test_each_api_reports_a_cut_off_call_in_its_own_shape(qwen_tokenizer):
    from dflash2_mlx.server.anthropic.api import MessagesFormatter
    from dflash2_mlx.server.openai.api import ChatFormatter
    from dflash2_mlx.server.responses.api import ResponsesRequest, Turn
    from dflash2_mlx.server.responses.output import ResponsesFormatter

    text = '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3, "city": "Par'
    chat = ChatFormatter(_run(qwen_tokenizer, text, 5, finish="length"), "m").body()["choices"][0]
    assert chat["finish_reason"] == "length" and chat["message"]["content"] is None
    assert chat["message"]["tool_calls"][0]["function"]["arguments"] == '{"days": 3, "city": "Par'
    messages = MessagesFormatter(_run(qwen_tokenizer, text, 5, finish="length"), "m").body()
    assert messages["stop_reason"] == "max_tokens"
    assert [(b["type"], b["input"]) for b in messages["content"]] == [("tool_use", {"days": 3})]
    req = ResponsesRequest(model="m", input="hi")
    resp = ResponsesFormatter(
        _run(qwen_tokenizer, text, 5, finish="length"), req, Turn(chat={}, input_items=[]), 16, None
    ).body()
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(i["type"], i["status"]) for i in resp["output"]] == [("function_call", "incomplete")]


# ---- bounded numbers ---------------------------------------------------------------------------


def test_unbounded_numbers_get_bounds_and_a_schemas_own_bounds_are_kept():
    from dflash2_mlx.server.argument_bounds import LIMIT, bounded_numbers

    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": ["number", "null"]},
            "low": {"type": "integer", "minimum": 1},
            "step": {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 10},
            "huge": {"type": "integer", "minimum": 10**20},
            "enum": {"enum": [1, 2]},
            "list": {"type": "array", "items": {"$ref": "#/$defs/k"}},
        },
        "$defs": {"k": {"type": "integer"}},
        "required": ["n"],
    }
    out = bounded_numbers(schema)
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": -LIMIT, "maximum": LIMIT}
    assert props["x"] == {"type": ["number", "null"], "minimum": -LIMIT, "maximum": LIMIT, "multipleOf": 1e-9}
    assert props["low"] == {"type": "integer", "minimum": 1, "maximum": LIMIT}
    assert props["step"] == {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 10, "minimum": -LIMIT}
    assert props["huge"] == {"type": "integer", "minimum": 10**20}  # a range the client asked for stays possible
    assert props["enum"] == {"enum": [1, 2]} and out["$defs"]["k"]["maximum"] == LIMIT
    assert schema["properties"]["n"] == {"type": "integer"}  # the client's schema is not touched


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tiny.write_tokenizer(path)
    return tiny.load_tokenizer(path)


def _accepts(schema: dict, text: str, tokenizer) -> bool:
    """Whether the grammar of ``schema`` (as forced tool arguments get it) takes ``text`` whole."""
    import llguidance

    from dflash2_mlx.constraints.grammar import Grammar, json_schema_rules
    from dflash2_mlx.server.argument_bounds import bounded_numbers

    grammar = Grammar(json_schema_rules(bounded_numbers(schema)), tokenizer, [tiny.EOS_ID])
    matcher = llguidance.LLMatcher(grammar.llg_tokenizer, grammar.grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(ids) < len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


@pytest.mark.parametrize(
    "schema,text,ok",
    [
        ({"type": "integer"}, "123456789012345", True),
        ({"type": "integer"}, "-999999999999999", True),
        ({"type": "integer"}, "1234567890123456", False),
        ({"type": "number"}, "-3.141592653", True),
        ({"type": "number"}, "123456789012345.5", True),
        ({"type": "number"}, "3.1415926535", False),
        ({"type": "number"}, "1234567890123456", False),
        ({"type": "integer", "maximum": 10**18}, "1000000000000000000", True),
    ],
)
def test_the_grammar_enforces_the_digit_bounds(byte_tokenizer, schema, text, ok):
    assert _accepts(schema, text, byte_tokenizer) is ok
