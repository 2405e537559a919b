"""Tool calls the token limit cuts off, malformed calls and template markup, in all three APIs
(issue 32 part 1: "no markup in content, ever").

The looping model: the embedded pair with a logit_bias of +100 on the token "3", forced into a
``get_weather(days: integer, city: string)`` call. Whatever the weights predict, it writes "3"
wherever the grammar allows one: ``days`` gets the digit bound's 15 threes (without the bound it
would write digits until max_tokens), then ``city`` is "333..." until max_tokens cuts the call off.
So the truncated call is known exactly, and every API must report it as a call, never as text.
"""

from __future__ import annotations

import json
import re

import pytest
from server_helpers import running_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MODEL = "tiny-code-demo-target"
MAX_TOKENS = 100
# days first: the bounded integer comes before the string the model loops in
LOOP_PARAMETERS = {
    "type": "object",
    "properties": {"days": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["days", "city"],
}
# issue 32's failing request: one get_weather(city, days) tool, tool_choice "required", 120 tokens
ISSUE_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
QUESTION = "What's the weather in Paris for the next 3 days?"
# the cut-off arguments: 15 digits (the bound), then the string the limit cut off
TRUNCATED = re.compile(r'\{"days": 3{15}, "city": "3+')
MARKUP = ("<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>")


def _clean(text) -> bool:
    return text is None or not any(m in text for m in MARKUP)


@pytest.fixture(scope="module")
def three_bias(embedded_pair):
    from mlx_lm.utils import load_tokenizer

    ids = load_tokenizer(embedded_pair[0]).encode("3", add_special_tokens=False)
    assert len(ids) == 1
    return {str(ids[0]): 100}


def _openai_body(three_bias, stream=False):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "tool_choice": "required",
        "logit_bias": three_bias,
        "stream": stream,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": LOOP_PARAMETERS}}],
    }


def _anthropic_body(three_bias, stream=False):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "tool_choice": {"type": "any"},
        "logit_bias": three_bias,
        "stream": stream,
        "tools": [{"name": "get_weather", "input_schema": LOOP_PARAMETERS}],
    }


def _responses_body(three_bias, stream=False):
    return {
        "model": MODEL,
        "input": QUESTION,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "tool_choice": "required",
        "logit_bias": three_bias,
        "stream": stream,
        "tools": [{"type": "function", "name": "get_weather", "parameters": LOOP_PARAMETERS}],
    }


# ---- in process: every API, streamed and not ---------------------------------------------------


@pytest.fixture(scope="module")
def app(embedded_pair):
    """The embedded pair in process, speculation pinned at blocks of 8 (the issue's server)."""
    from fastapi.testclient import TestClient

    from dflash2_mlx.server import ServerConfig, create_app
    from dflash2_mlx.server.worker import Worker

    target, drafter = (str(p) for p in embedded_pair)
    worker = Worker(target, drafter, block_size=8, prefix_cache_bytes=0, max_context=1024)
    with TestClient(
        create_app(ServerConfig(model=target, draft_model=drafter), worker), raise_server_exceptions=False
    ) as client:
        assert worker.ready.wait(120), worker.error
        yield client


def _events(response) -> list[tuple[str, dict]]:
    """(event name or "", data) of a server-sent event stream, [DONE] left out."""
    out, name = [], ""
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line[6:] != "[DONE]":
            out.append((name, json.loads(line[6:])))
            name = ""
    return out


def test_a_chat_call_cut_off_by_max_tokens_is_a_partial_tool_call_with_finish_reason_length(app, three_bias):
    r = app.post("/v1/chat/completions", json=_openai_body(three_bias))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert TRUNCATED.fullmatch(call["function"]["arguments"]), call["function"]["arguments"]


def test_a_streamed_chat_call_cut_off_arrives_as_a_tool_call_delta_then_length(app, three_bias):
    r = app.post("/v1/chat/completions", json=_openai_body(three_bias, stream=True))
    chunks = [data for _, data in _events(r) if data.get("choices")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all(_clean(d.get("content")) and not (d.get("content") or "").strip() for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert TRUNCATED.fullmatch(calls[0]["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_an_anthropic_tool_use_cut_off_has_stop_reason_max_tokens_and_the_complete_part_as_input(app, three_bias):
    r = app.post("/v1/messages", json=_anthropic_body(three_bias))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop_reason"] == "max_tokens"
    # the city string was cut off: the input holds what is complete, as Anthropic's SDK reads a stream
    assert body["content"] == [
        {"type": "tool_use", "id": body["content"][0]["id"], "name": "get_weather", "input": {"days": 333333333333333}}
    ]


def test_a_streamed_anthropic_tool_use_cut_off_sends_the_partial_json_then_max_tokens(app, three_bias):
    events = _events(app.post("/v1/messages", json=_anthropic_body(three_bias, stream=True)))
    starts = [d["content_block"] for name, d in events if name == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["name"] == "get_weather"
    partial = "".join(
        d["delta"]["partial_json"]
        for name, d in events
        if name == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    )
    assert TRUNCATED.fullmatch(partial)
    assert [d["delta"]["stop_reason"] for name, d in events if name == "message_delta"] == ["max_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "streamed"])
def test_a_responses_call_cut_off_is_an_incomplete_function_call_in_an_incomplete_response(app, three_bias, stream):
    r = app.post("/v1/responses", json=_responses_body(three_bias, stream))
    assert r.status_code == 200, r.text
    if stream:
        events = _events(r)
        assert not [d for name, d in events if name == "response.output_text.delta"]
        body = [d["response"] for name, d in events if name == "response.incomplete"][0]
    else:
        body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = body["output"]
    assert item["type"] == "function_call" and item["status"] == "incomplete" and item["name"] == "get_weather"
    assert TRUNCATED.fullmatch(item["arguments"])


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "streamed"])
def test_the_issues_failing_request_gives_clean_calls_in_every_api(app, stream):
    """Issue 32's request as it was (no bias): whatever this weak model writes, no markup reaches
    the text, every call is reported as a call, and numbers keep the digit bound."""
    tool = {"name": "get_weather", "parameters": ISSUE_PARAMETERS}
    base = {"temperature": 0, "stream": stream}
    chat = app.post(
        "/v1/chat/completions",
        json={
            **base,
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 120,
            "tool_choice": "required",
            "tools": [{"type": "function", "function": tool}],
        },
    )
    messages = app.post(
        "/v1/messages",
        json={
            **base,
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 120,
            "tool_choice": {"type": "any"},
            "tools": [{"name": "get_weather", "input_schema": ISSUE_PARAMETERS}],
        },
    )
    responses = app.post(
        "/v1/responses",
        json={
            **base,
            "model": MODEL,
            "input": QUESTION,
            "max_output_tokens": 120,
            "tool_choice": "required",
            "tools": [{"type": "function", **tool}],
        },
    )
    for r in (chat, messages, responses):
        assert r.status_code == 200, r.text
        assert _clean(r.text), r.text[:2000]
    calls = re.findall(r'\\?"days\\?": (\d+)', chat.text + messages.text + responses.text)
    assert all(len(days) <= 15 for days in calls)
    if not stream:
        assert chat.json()["choices"][0]["message"]["tool_calls"]
        assert chat.json()["choices"][0]["message"]["content"] is None
        assert all(b["type"] == "tool_use" for b in messages.json()["content"])
        assert all(item["type"] == "function_call" for item in responses.json()["output"])


# ---- a real server and the official SDKs (non-streamed) ---------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("truncated") / "serve.log"
    with running_server(["--block-size", "8"], log, wait=180) as s:
        yield s
    assert "Traceback" not in s.log_text()


def test_the_openai_sdk_reads_the_truncated_call_from_tool_calls(server, three_bias):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=120, max_retries=0)
    body = _openai_body(three_bias)
    r = client.chat.completions.create(extra_body={"logit_bias": body.pop("logit_bias")}, **body)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and TRUNCATED.fullmatch(call.function.arguments)


def test_the_anthropic_sdk_reads_a_tool_use_block_and_max_tokens(server, three_bias):
    client = anthropic.Anthropic(base_url=server.base, api_key="x", timeout=120, max_retries=0)
    body = _anthropic_body(three_bias)
    body.pop("stream")
    # anthropic 2.x's create() takes no temperature argument: both go in the body as they are
    extra = {"logit_bias": body.pop("logit_bias"), "temperature": body.pop("temperature")}
    r = client.messages.create(extra_body=extra, **body)
    assert r.stop_reason == "max_tokens"
    [block] = r.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"days": 333333333333333}
