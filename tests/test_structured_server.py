"""Structured output and forced tools through a real `dflash2-mlx serve` on the embedded pair, with
the official openai and anthropic clients, speculation on (every answer has verify cycles).

The embedded pair is a code model that knows nothing about JSON or tools: whatever it "wants" to
write, the grammar alone must make the answer valid. The schemas have finite languages (bounded
strings, numbers and arrays), so every answer ends with the stop token, not max_tokens.
"""

from __future__ import annotations

import json

import pytest
from server_helpers import running_server

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {"$ref": "#/$defs/address"},
        "nick": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"const": "12345"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        }
    },
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
PARAMS = {"get_weather": WEATHER, "get_time": CLOCK}
MODEL = "tiny-code-demo-target"
MESSAGES = [{"role": "user", "content": "def describe(person):"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "serve.log"
    # speculation pinned (the issue's setting): a grammar lowers acceptance, and the break-even
    # controller could otherwise decode these answers plainly
    with running_server(["--block-size", "8"], log, wait=180) as s:
        yield s


@pytest.fixture(scope="module")
def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.base, api_key="x", timeout=120, max_retries=0)


def _speculated(raw) -> dict:
    spec = raw.model_extra["speculative"] if hasattr(raw, "model_extra") else raw["speculative"]
    assert spec["verify_steps"] > 0
    return spec


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "sampled"])
def test_json_schema_answers_parse_and_validate(openai_client, sampling):
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=300,
        **sampling,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    _speculated(r)


def test_json_schema_streamed_equals_complete(openai_client):
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=300,
        temperature=0,  # the pair samples by default
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    whole = openai_client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(stream=True, **kw) if c.choices
    )
    assert streamed == whole


def test_the_sdks_parse_helper_gets_its_pydantic_model_back(openai_client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=8)
        kind: Literal["cat", "dog"]
        legs: int = Field(ge=0, le=8)

    r = openai_client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=200, response_format=Pet)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def _check_calls(calls, names, exactly_one=False):
    assert calls, "no tool call"
    if exactly_one:
        assert len(calls) == 1
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "sampled"])
def test_tool_choice_required_gives_one_valid_call(openai_client, sampling):
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=300,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        **sampling,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, {"get_weather", "get_time"}, exactly_one=True)
    _speculated(r)


def test_parallel_tool_calls_are_each_valid(openai_client):
    """With parallel calls allowed the grammar lets the model write one call after another (this
    code model never stops by itself): every call it completed is valid; the one max_tokens cut off
    is the last (tests/test_server_truncated_tools.py pins its shape)."""
    r = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=150, tools=TOOLS, tool_choice="required"
    )
    calls = r.choices[0].message.tool_calls
    completed = calls[:-1] if r.choices[0].finish_reason == "length" else calls
    _check_calls(completed, {"get_weather", "get_time"})
    assert len(completed) >= 2 and calls[-1].function.name in PARAMS


def test_a_named_tool_choice_without_parallel_calls_gives_exactly_that_one_call(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=300,
        tools=TOOLS,
        parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    _check_calls(r.choices[0].message.tool_calls, {"get_time"}, exactly_one=True)


def test_forced_tool_calls_stream_as_tool_call_deltas(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=300,
            tools=TOOLS,
            stream=True,
            parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_schema_keyword_the_engine_cannot_enforce_is_a_400_naming_it(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "s",
                    "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                },
            },
        )
    assert "uniqueItems" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            tool_choice="required",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "object"}}}}],
        )
    assert "'not'" in str(err.value) and "tools[0].parameters" in str(err.value)


def test_anthropic_output_config_format_is_honoured(anthropic_client):
    r = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=300,
        messages=MESSAGES,
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
    )
    text = "".join(b.text for b in r.content if b.type == "text")
    jsonschema.validate(json.loads(text), PERSON)
    assert r.stop_reason == "end_turn"
    _speculated(r.model_extra)


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ],
    ids=["any", "tool"],
)
def test_anthropic_tool_choice_forces_a_valid_tool_use(anthropic_client, choice):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    r = anthropic_client.messages.create(
        model=MODEL, max_tokens=300, messages=MESSAGES, tools=tools, tool_choice=choice
    )
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1
    if choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, PARAMS[uses[0].name])
