"""The clients agents and apps use, against a real `dflash2-mlx serve` process on the embedded pair:
the official openai SDK (chat and the Responses API), anthropic, openai-agents (whose default model
is the Responses API) and langchain-openai.

The pair is a tiny code model: answers are made deterministic with logit_bias (a dflash2-mlx
extension the Responses route accepts too) rather than by hoping the model stops or does not."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel
from server_helpers import running_server

openai = pytest.importorskip("openai")
KEY = "sk-clients"
MODEL = "tiny-alias"
MAX_CONTEXT = 512
IM_END, EOS = 2, 0  # the embedded pair's end-of-turn and end-of-text tokens
NEVER_STOP = {str(IM_END): -100, str(EOS): -100}  # runs to max_output_tokens
STOP_NOW = {str(IM_END): 100}  # ends at once: an empty, complete answer
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# Finite answers (enums, booleans): a constrained answer ends by itself, long before max tokens.
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


@pytest.fixture(scope="module")
def server(embedded_pair, tmp_path_factory):
    target, drafter = embedded_pair
    log = tmp_path_factory.mktemp("clients") / "server.log"
    args = [
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--api-key",
        KEY,
        "--served-model-name",
        MODEL,
        "--max-context",
        str(MAX_CONTEXT),
        "--default-max-tokens",
        "16",
        "--request-timeout",
        "60",
        "--block-size",
        "8",
    ]  # speculation pinned: the controller may decode low-acceptance answers plainly
    with running_server(args, log) as srv:
        yield srv
    assert "Traceback" not in srv.log_text(), srv.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def respond(client, input="def fib(n):", **kw):
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("temperature", 0)
    kw.setdefault("extra_body", {"logit_bias": NEVER_STOP})
    return client.responses.create(model=MODEL, input=input, **kw)


# ---- the Responses API through the official SDK ------------------------------------------------


def test_responses_create_returns_a_typed_response_with_usage_and_speculation(client):
    r = respond(client)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text and r.output_text
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.model_extra["speculative"]["verify_steps"] > 0
    done = respond(client, extra_body={"logit_bias": STOP_NOW})
    assert done.status == "completed" and done.incomplete_details is None and done.output_text == ""


def test_responses_stream_sends_the_standard_event_sequence(client):
    full = respond(client)
    events = list(respond(client, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.output_text.delta"] * len(deltas)
        + [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == full.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == full.output_text and final.usage.output_tokens == full.usage.output_tokens
    assert final.model_extra["speculative"] == full.model_extra["speculative"]
    # The SDK's stream helper assembles a completed response: one ended by a stop string (a
    # dflash2-mlx extension) taken from the greedy text.
    text = full.output_text
    cut = next(i for i in range(3, len(text) - 1) if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i)
    with client.responses.stream(
        model=MODEL,
        input="def fib(n):",
        max_output_tokens=12,
        temperature=0,
        extra_body={"logit_bias": NEVER_STOP, "stop": [text[cut : cut + 2]]},
    ) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == streamed == text[:cut]


def test_logprobs_come_with_the_output_text_and_its_deltas(client):
    r = respond(client, include=["message.output_text.logprobs"], top_logprobs=2)
    entries = r.output[0].content[0].logprobs
    assert len(entries) == r.usage.output_tokens and "".join(e.token for e in entries) == r.output_text
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-4)
    events = list(respond(client, include=["message.output_text.logprobs"], top_logprobs=2, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, round(lp.logprob, 4)) for lp in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]


def test_previous_response_id_continues_the_stored_conversation(client):
    first = respond(client, "Name a color.", instructions="Be terse.")
    second = respond(client, "Another one?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the same conversation sent in full gives the same prompt and the same greedy answer
    explicit = respond(
        client,
        [
            {"role": "user", "content": "Name a color."},
            *[o.model_dump() for o in first.output],
            {"role": "user", "content": "Another one?"},
        ],
    )
    assert (
        second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    )
    assert second.output_text == explicit.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        respond(client, "and?", previous_response_id=second.id)  # its chain lost its first turn
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    unstored = respond(client, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_call_items_and_their_outputs_are_rendered(client):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    plain = respond(client, question, tools=[TOOL])
    rounds = respond(
        client,
        question
        + [
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        ],
        tools=[TOOL],
    )
    assert rounds.usage.input_tokens > plain.usage.input_tokens + 20
    assert plain.tools[0].name == "get_weather" and plain.tool_choice == "auto"
    no_tools = respond(client, question)
    assert plain.usage.input_tokens > no_tools.usage.input_tokens + 50  # the tools are in the system turn


@pytest.mark.parametrize(
    "field, kw",
    [
        ("truncation", {"truncation": "auto"}),
        ("background", {"background": True}),
        ("tools[0].type", {"tools": [{"type": "web_search"}]}),
        ("include", {"include": ["file_search_call.results"]}),
        (
            "input[0].content[0].type",
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}
                ]
            },
        ),
        ("conversation", {"conversation": "conv_1"}),
        ("max_tool_calls", {"max_tool_calls": 2}),
        ("tool_choice", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}),
    ],
)
def test_unsupported_responses_fields_get_a_400_naming_them(client, field, kw):
    with pytest.raises(openai.BadRequestError) as e:
        respond(client, **kw)
    assert e.value.body["param"] == field, e.value.body


# ---- structured output and forced tool calls, speculation on ------------------------------------


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.95, "extra_body": {"seed": 7}}]
)
def test_responses_json_schema_answers_parse_and_validate(client, sampling):
    jsonschema = pytest.importorskip("jsonschema")
    kw = {"max_output_tokens": 60, "extra_body": {}, **sampling}
    r = respond(
        client,
        "Weather in Paris?",
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}},
        **kw,
    )
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.model_extra["speculative"]["verify_steps"] > 0
    parsed = client.responses.parse(model=MODEL, input="Weather in Paris?", text_format=Weather, **kw)
    assert parsed.output_parsed.city in ("Paris", "Rome") and isinstance(parsed.output_parsed.sunny, bool)


def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_the_responses_field(client):
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as e:
        respond(client, text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert e.value.body["param"].startswith("text.format.schema") and "uniqueItems" in e.value.body["message"]
    assert "response_format" not in e.value.body["message"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_forced_tool_calls_are_valid_function_call_items(client, tool_choice):
    jsonschema = pytest.importorskip("jsonschema")
    other = {
        **TOOL,
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    }
    kw = dict(
        tools=[TOOL, other] if tool_choice == "required" else [other, TOOL],
        tool_choice=tool_choice,
        max_output_tokens=60,
        extra_body={"logit_bias": STOP_NOW},
    )  # ends once a call is complete
    r = respond(client, "Weather in Paris?", **kw)
    assert r.status == "completed" and r.output and all(o.type == "function_call" for o in r.output)
    for call in r.output:
        assert call.call_id and call.name in ("get_weather", "get_time")
        jsonschema.validate(
            json.loads(call.arguments), TOOL["parameters"] if call.name == "get_weather" else other["parameters"]
        )
    if tool_choice != "required":
        assert [o.name for o in r.output] == ["get_weather"]
    assert r.model_extra["speculative"]["verify_steps"] > 0
    events = list(respond(client, "Weather in Paris?", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [(o.name, o.arguments) for o in events[-1].response.output] == [(o.name, o.arguments) for o in r.output]


def test_the_embedded_pairs_forced_tool_call_comes_back_as_chat_tool_calls(client):
    """The pair's template renders tools Qwen-style, so the grammar's <tool_call> text is parsed."""
    tool = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


# ---- smaller fixes -----------------------------------------------------------------------------


def test_context_overflow_uses_the_words_clients_recognise(server, client):
    long = "word " * (MAX_CONTEXT + 20)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    assert e.value.body["message"].startswith(
        f"This model's maximum context length is {MAX_CONTEXT} tokens. However, your messages resulted in "
    )
    with pytest.raises(openai.BadRequestError) as e:
        respond(client, long)
    assert e.value.code == "context_length_exceeded" and "maximum context length" in e.value.body["message"]
    anthropic = pytest.importorskip("anthropic")
    a = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": long}])
    message = e.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(f" tokens > {MAX_CONTEXT - 1} maximum")


def test_legacy_functions_are_refused_not_dropped(client):
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    for kw, param in (({"functions": [fn]}, "functions"), ({"function_call": "auto"}, "function_call")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=kw
            )
        assert e.value.body["param"] == param and "tools" in e.value.body["message"]


def test_models_accept_x_api_key_and_embeddings_say_they_are_not_served(server, client):
    r = httpx.get(server.base + "/v1/models", headers={"x-api-key": KEY})
    assert r.status_code == 200 and MODEL in [m["id"] for m in r.json()["data"]]
    assert httpx.get(server.base + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model=MODEL, input="hello")
    assert "does not serve embeddings" in e.value.body["message"]


def test_anthropic_messages_plain_and_streamed(server):
    anthropic = pytest.importorskip("anthropic")
    a = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)
    # greedy (the pair samples by default), so the stream and the whole answer are the same text
    kw = dict(
        model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "def fib(n):"}], extra_body={"temperature": 0}
    )
    msg = a.messages.create(**kw)
    with a.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == "".join(b.text for b in msg.content if b.type == "text")
    assert msg.model_extra["speculative"]["verify_steps"] > 0


# ---- openai-agents: its default model is the Responses API --------------------------------------


def test_openai_agents_default_model_runs_with_a_function_tool(server):
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        calls.append(city)
        return "sunny"

    set_tracing_disabled(True)
    set_default_openai_client(
        openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0), use_for_tracing=False
    )
    settings = ModelSettings(temperature=0, max_tokens=8, extra_body={"logit_bias": STOP_NOW})
    with_tool = Agent(
        name="weather", instructions="Answer briefly.", model=MODEL, tools=[get_weather], model_settings=settings
    )
    without = Agent(name="plain", instructions="Answer briefly.", model=MODEL, model_settings=settings)

    async def runs():  # one event loop: the client's connections belong to it
        streamed = Runner.run_streamed(without, "def fib(n):")
        kinds = {e.type async for e in streamed.stream_events()}
        return (
            await Runner.run(with_tool, "Weather in Paris?"),
            await Runner.run(without, "Weather in Paris?"),
            streamed,
            kinds,
        )

    result, plain, streamed, kinds = asyncio.run(runs())
    assert "raw_response_event" in kinds and streamed.final_output == ""
    assert isinstance(
        agents.models.openai_provider.OpenAIProvider().get_model(MODEL),
        agents.models.openai_responses.OpenAIResponsesModel,
    )
    assert result.final_output == "" and calls == []  # the answer ended at once (STOP_NOW)
    [raw] = result.raw_responses
    assert raw.usage.input_tokens > plain.raw_responses[0].usage.input_tokens + 50  # the tool was rendered


def test_openai_agents_forced_tool_call_round_trip_and_structured_output(server):
    pytest.importorskip("agents")
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Weather for a city."""
        calls.append(city)
        return "sunny"

    set_tracing_disabled(True)
    set_default_openai_client(
        openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0), use_for_tracing=False
    )
    # The first turn must call the tool; then the SDK resets tool_choice and the answer ends at once.
    forced = Agent(
        name="weather",
        model=MODEL,
        tools=[get_weather],
        model_settings=ModelSettings(
            temperature=0, max_tokens=60, tool_choice="get_weather", extra_body={"logit_bias": STOP_NOW}
        ),
    )
    structured = Agent(
        name="structured", model=MODEL, output_type=Weather, model_settings=ModelSettings(temperature=0, max_tokens=60)
    )

    async def runs():
        return (
            await Runner.run(forced, "Weather in Paris?"),
            await Runner.run(structured, "Weather in Paris?"),
            await Runner.run(forced, "Weather in Paris?", auto_previous_response_id=True),
        )

    tool_run, structured_run, chained = asyncio.run(runs())
    assert len(calls) == 2 and calls[0] in ("Paris", "Rome") and calls[1] == calls[0]
    for run in (tool_run, chained):
        assert [r.output[0].type for r in run.raw_responses] == ["function_call", "message"]
        assert run.final_output == ""
    # chained: the second turn sent only the tool's output and the first response's id, and the
    # server put the stored call in front of it: the same prompt as the unchained run's
    stored = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY).responses.retrieve(
        chained.raw_responses[1].response_id
    )
    assert stored.previous_response_id == chained.raw_responses[0].response_id
    assert chained.raw_responses[1].usage.input_tokens == tool_run.raw_responses[1].usage.input_tokens
    assert structured_run.final_output.city in ("Paris", "Rome")


# ---- langchain-openai --------------------------------------------------------------------------


def test_langchain_chat_openai_on_chat_completions_and_the_responses_api(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    kw = dict(base_url=server.base + "/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=8, max_retries=0)
    chat = ChatOpenAI(**kw).invoke("def fib(n):")
    assert isinstance(chat.content, str) and chat.response_metadata["finish_reason"] in ("length", "stop")
    responses = ChatOpenAI(**kw, use_responses_api=True).invoke("def fib(n):")
    assert responses.response_metadata["id"].startswith("resp_")
    assert responses.text == chat.content  # the same greedy answer through either API
    assert responses.usage_metadata["output_tokens"] == chat.usage_metadata["output_tokens"]
    chunks = list(ChatOpenAI(**kw, use_responses_api=True, streaming=True).stream("def fib(n):"))
    assert "".join(c.text for c in chunks) == chat.content


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_with_structured_output_default_and_function_calling(server, responses_api):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.base + "/v1",
        api_key=KEY,
        model=MODEL,
        temperature=0,
        max_tokens=60,
        max_retries=0,
        use_responses_api=responses_api,
    )
    # json_schema is the default; function_calling forces the tool (strict: no properties beyond
    # the schema's, or the tiny model may write extra keys until max_tokens)
    for method in ("json_schema", "function_calling"):
        answer = (
            llm.with_structured_output(Weather)
            if method == "json_schema"
            else llm.with_structured_output(Weather, method=method, strict=True)
        ).invoke("Weather in Paris?")
        assert isinstance(answer, Weather) and answer.city in ("Paris", "Rome"), method
