"""The Responses API's pieces: input items -> chat messages, refused fields, the bounded response
store, and output (reasoning, text, tool calls) -> Response items and stream events, each checked
against the official openai SDK's types. The real server process is driven in test_server_clients.py."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter
from server_helpers import END_THINK, qwen_style_checkpoint

from dflash2_mlx.server.errors import APIError
from dflash2_mlx.server.responses.api import ResponsesRequest, to_messages, translate
from dflash2_mlx.server.responses.output import ResponsesFormatter
from dflash2_mlx.server.responses.store import ChainBroken, ResponseStore

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def request(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **kw})


def _response(rid: str, previous=None, text="x") -> dict:
    return {
        "id": rid,
        "previous_response_id": previous,
        "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
    }


# ---- input -------------------------------------------------------------------------------------


def test_assistant_side_items_merge_into_one_turn_and_outputs_become_tool_messages():
    items = [
        {"role": "developer", "content": "Be terse."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Call the tool."}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    assert to_messages(items, "input") == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Call the tool.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_a_request_becomes_the_equivalent_chat_request():
    turn = translate(
        request(
            input=[{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
            instructions="I",
            max_output_tokens=7,
            temperature=0.5,
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
            reasoning={"effort": "none"},
            seed=3,
        ),
        ResponseStore(),
    )
    assert turn.chat == {
        "model": "m",
        "stream": False,
        "temperature": 0.5,
        "parallel_tool_calls": False,
        "max_completion_tokens": 7,
        "seed": 3,
        "messages": [{"role": "system", "content": "I\n\nS"}, {"role": "user", "content": "Q"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
        },
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert turn.input_items[0] == {"role": "system", "content": "S"}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"top_logprobs": 3, "include": ["message.output_text.logprobs", "web_search_call.results"]}, "include"),
        ({"prompt": {"id": "p"}}, "prompt"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"include": ["message.input_image.image_url"]}, "include"),
        ({"text": {"verbosity": "high"}}, "text.verbosity"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"tool_choice": {"type": "mcp", "server_label": "x"}}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": ""}, "input"),
    ],
)
def test_fields_this_server_cannot_honour_get_a_400_naming_them(fields, param):
    with pytest.raises(APIError) as e:
        translate(request(**fields), ResponseStore())
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_fields_with_no_op_values_are_accepted():
    turn = translate(
        request(
            background=False,
            truncation="disabled",
            service_tier="auto",
            top_logprobs=0,
            include=[],
            store=True,
            metadata={"k": "v"},
            user="u",
            prompt_cache_key="k",
            safety_identifier="s",
            stream_options={"include_obfuscation": False},
            prompt_cache_retention="in_memory",
        ),
        ResponseStore(),
    )
    assert turn.chat["messages"] == [{"role": "user", "content": "hi"}]


# ---- the store ---------------------------------------------------------------------------------


def test_store_evicts_least_recently_used_by_count_and_by_bytes():
    store = ResponseStore(max_entries=2)
    for rid in ("a", "b"):
        store.put(_response(rid), [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put(_response("c"), [])
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    one = len(json.dumps(_response("d", text="y" * 1000))) + 2
    store = ResponseStore(max_bytes=int(2.5 * one))
    for rid in "def":
        store.put(_response(rid, text="y" * 1000), [])
    assert [store.get(r) is not None for r in "def"] == [False, True, True] and store.nbytes <= 2.5 * one
    store.put(_response("huge", text="z" * 10 * one), [])  # larger than the whole store: not kept
    assert store.get("huge") is None and store.get("f") is not None


def test_a_chain_is_rebuilt_oldest_first_and_using_it_refreshes_every_turn():
    store = ResponseStore(max_entries=3)
    store.put(_response("r1", text="one"), [{"role": "user", "content": "q1"}])
    store.put(_response("r2", "r1", text="two"), [{"role": "user", "content": "q2"}])
    store.put(_response("other"), [])
    texts = [
        i["content"] if isinstance(i["content"], str) else i["content"][0]["text"] for i in store.conversation("r2")
    ]
    assert texts == ["q1", "one", "q2", "two"]
    store.put(_response("new"), [])  # evicts "other", not r1: continuing r2 refreshed r1 too
    assert store.get("other") is None and store.conversation("r2")
    store.delete("r1")
    with pytest.raises(ChainBroken) as e:
        store.conversation("r2")
    assert e.value.args[0] == "r1"


# ---- output ------------------------------------------------------------------------------------


class Event:
    def __init__(self, text, finish=None):
        self.tokens, self.text, self.stats, self.finish_reason, self.logprobs = [1], text, None, finish, None


@pytest.fixture(scope="module")
def qwen_dir(tiny_checkpoints, tmp_path_factory):
    return qwen_style_checkpoint(tiny_checkpoints[0], tmp_path_factory.mktemp("qwen-responses") / "qwen-style")


@pytest.mark.parametrize("summary", [False, True])
def test_reasoning_text_and_tool_calls_become_items_and_sdk_valid_events(qwen_dir, summary):
    from mlx_lm.utils import load_tokenizer

    from dflash2_mlx.server.chat import OutputParser
    from dflash2_mlx.server.stream import Accumulator

    tok = load_tokenizer(qwen_dir, eos_token_ids=[298])
    text = (
        'The user wants weather.</think>\n\nChecking.<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>'
    )
    req = request(tools=[TOOL], stream=True, reasoning={"summary": "auto"} if summary else None)
    store = ResponseStore()
    turn = translate(req, store)
    acc = Accumulator(tok, 10, OutputParser(tok, "reasoning", turn.chat["tools"]))
    fmt = ResponsesFormatter(acc, req, turn, 16, store)
    chunks = fmt.start()
    for i in range(0, len(text), 3):  # small pieces: markers split across them
        event = Event(text[i : i + 3], "stop" if i + 3 >= len(text) else None)
        chunks += fmt.event(event, acc.add(event))
    chunks += fmt.end([])
    events = [json.loads(line[6:]) for c in chunks for line in c.decode().splitlines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    kinds = [e["type"] for e in events]
    reasoning_delta = "response.reasoning_summary_text.delta" if summary else "response.reasoning_text.delta"
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added" if summary else "response.content_part.added",
    ]
    assert reasoning_delta in kinds and "response.output_text.delta" in kinds
    assert kinds[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(events[-1]["response"])
    reasoning, message, call = final.output
    parts = reasoning.summary if summary else reasoning.content
    assert reasoning.type == "reasoning" and parts[0].text == "The user wants weather."
    assert message.type == "message" and final.output_text == "Checking."
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert final.status == "completed" and store.get(final.id) == events[-1]["response"]

    # the non-streamed body is the same response
    def without_ids(output):
        return [o.model_dump(exclude={"id"}) for o in output]

    assert without_ids(Response.model_validate(fmt.body()).output) == without_ids(final.output)


@pytest.fixture(scope="module")
def qwen_app(qwen_dir, tiny_checkpoints):
    """An in-process server on the tiny target with a Qwen-style thinking template."""
    from fastapi.testclient import TestClient

    from dflash2_mlx.server import ServerConfig, create_app

    app = create_app(
        ServerConfig(model=str(qwen_dir), draft_model=str(tiny_checkpoints[1]), default_max_tokens=4, max_context=1024)
    )
    with TestClient(app, raise_server_exceptions=False) as c:
        assert app.state.worker.ready.wait(60)
        yield c


def test_a_thinking_template_gives_a_reasoning_item(qwen_app):
    c = qwen_app
    body = {
        "model": "qwen-style",
        "input": "Weather?",
        "max_output_tokens": 6,
        "temperature": 0,
        "logit_bias": {str(END_THINK): -100},
    }  # </think> banned: every token is reasoning
    r = Response.model_validate(c.post("/v1/responses", json=body).json())
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == ""
    assert r.output[0].content[0].text and r.usage.output_tokens_details.reasoning_tokens > 0
    off = c.post("/v1/responses", json={**body, "reasoning": {"effort": "none"}}).json()
    assert off["usage"]["input_tokens"] == r.usage.input_tokens + 4  # "\n\n</think>\n\n" closes the block
    assert [o["type"] for o in off["output"]] == ["message"]


@pytest.mark.slow
def test_fuzzed_responses_requests_never_get_a_500(qwen_app):
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    )
    nested = st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=8,
    )
    item = st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                ["message", "function_call", "function_call_output", "reasoning", "web_search_call", None]
            ),
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
            "content": st.one_of(
                st.text(max_size=10),
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["input_text", "output_text", "input_image", "reasoning_text"]),
                            "text": st.one_of(st.text(max_size=8), scalars),
                        }
                    ),
                    max_size=2,
                ),
                scalars,
            ),
            "call_id": st.one_of(st.text(max_size=4), scalars),
            "name": st.sampled_from(["get_weather", "nope", 3]),
            "arguments": st.sampled_from(['{"city": "Paris"}', "{", 5]),
            "output": st.one_of(st.text(max_size=6), nested),
        }
    )
    plausible = {
        "input": st.one_of(st.text(max_size=10), st.lists(item, max_size=3), nested),
        "instructions": st.one_of(st.text(max_size=10), scalars),
        "max_output_tokens": st.one_of(st.integers(-2, 4), scalars),
        "temperature": st.one_of(st.floats(-1, 3), scalars),
        "top_p": st.one_of(st.floats(-1, 2), scalars),
        "tools": st.one_of(st.just([TOOL]), st.lists(nested, max_size=2)),
        "tool_choice": st.sampled_from(
            [
                "auto",
                "none",
                "required",
                "any",
                {"type": "function", "name": "get_weather"},
                {"type": "function", "name": "zzz"},
                {"type": "mcp"},
                3,
            ]
        ),
        "text": st.sampled_from(
            [
                {"format": {"type": "text"}},
                {"format": {"type": "json_object"}},
                {"format": 3},
                {"verbosity": "low"},
                {"format": {"type": "json_schema", "name": "x"}},
            ]
        ),
        "reasoning": st.sampled_from([{"effort": "none"}, {"effort": "high", "summary": "auto"}, {"x": 1}, "low"]),
        "previous_response_id": st.one_of(st.text(max_size=6), scalars),
        "store": scalars,
        "stream": st.booleans(),
        "include": st.one_of(st.lists(st.text(max_size=12), max_size=2), scalars),
        "truncation": st.sampled_from(["auto", "disabled", None, 1]),
        "metadata": nested,
        "background": scalars,
        "conversation": scalars,
        "parallel_tool_calls": scalars,
        "logit_bias": nested,
    }
    seen: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(changes=st.fixed_dictionaries({}, optional=plausible))
    def check(changes):
        body = {"model": "qwen-style", "input": "hi", "max_output_tokens": 3, **changes}
        r = qwen_app.post("/v1/responses", json=body)
        assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300], body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        elif not body.get("stream"):
            Response.model_validate(r.json())

    check()
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 10, seen
