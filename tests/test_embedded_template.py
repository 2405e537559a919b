"""The embedded pair's chat template: plain ChatML without tools (what the pair was trained on), and
Qwen3.5-style tools (signatures in the system turn, <tool_call> JSON text, <tool_response> user
turns) that mlx-lm's tool parser reads back, so forced tool calls round-trip through the server."""

from __future__ import annotations

import json

import pytest

from dflash2_mlx import assets
from dflash2_mlx.training.demo_pair import tokenizer as tk

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def wrapper():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(assets.demo_target_path())


def test_shipped_template_is_the_training_modules_template():
    shipped = json.loads((assets.demo_target_path() / "tokenizer_config.json").read_text())
    assert shipped["chat_template"] == tk.CHAT_TEMPLATE


def test_without_tools_it_renders_exactly_the_training_chatml(wrapper):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(assets.demo_target_path() / "tokenizer.json"))
    messages = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "    return x"}]
    ids = wrapper.apply_chat_template(messages, tokenize=True)
    assert list(ids) == tk.chat_ids(tok, messages[0]["content"], messages[1]["content"])
    text = wrapper.apply_chat_template(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"


def test_tools_render_qwen_style(wrapper):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    text = wrapper.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    system, user, assistant, results, prompt = text.split("<|im_start|>")[1:]
    assert (
        system.startswith("system\nBe terse.\n\n# Tools\n")
        and "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in system
    )
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert user == "user\nWeather in Paris and Rome?<|im_end|>\n"
    assert assistant == (
        'assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    )
    assert (
        results == "user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
    )
    assert prompt == "assistant\n"


def test_mlx_lm_parses_the_templates_tool_calls(wrapper):
    from dflash2_mlx.server.chat import OutputParser

    assert wrapper.has_tool_calling and wrapper.tool_call_start == "<tool_call>"
    parser = OutputParser(wrapper, "normal", TOOLS)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas = [d for i in range(0, len(text), 4) for d in parser.feed(text[i : i + 4])] + parser.finish()
    calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert not [d for d in deltas if d.kind == "content" and d.text.strip()]
