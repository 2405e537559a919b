"""`dflash2-mlx serve`: a real server process driven by the official openai and anthropic clients,
plus in-process tests (FastAPI's TestClient) for tool calls, reasoning, the prefix cache, JSON mode
and schema fuzzing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import END_THINK, labelled, metrics, qwen_style_checkpoint, running_server

openai = pytest.importorskip("openai")
KEY = "sk-test-key"
MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def server(embedded_pair, tmp_path_factory):
    """A real `serve` process on the embedded tiny pair (served also as "target" and "tiny-alias")."""
    target, drafter = embedded_pair
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = [
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--api-key",
        KEY,
        "--served-model-name",
        "target",
        "--served-model-name",
        "tiny-alias",
        "--max-context",
        str(MAX_CONTEXT),
        "--max-queue",
        "2",
        "--max-concurrent",
        "1",
        "--default-max-tokens",
        "16",
        "--request-timeout",
        "60",
        # the fixed loop: its statistics and seeded draws do not depend on measured timings
        # (the break-even controller's block sizes do; tests/test_controller.py covers it)
        "--block-size",
        "8",
    ]
    with running_server(args, log) as srv:
        yield srv
    assert "Traceback" not in srv.log_text(), srv.log_text()[-3000:]


@pytest.fixture(scope="module")
def end_bias(embedded_pair):
    """logit_bias banning the embedded target's end tokens: a completion then runs to its token
    limit or the context whatever the weights predict (the pair may be retrained, and another BLAS
    rounds differently), so tests that need a generation still running get one."""
    from dflash2_mlx.models.loading import load_target

    return {str(t): -100 for t in load_target(str(embedded_pair[0])).tokenizer.eos_token_ids}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def chat(client, content="Write a short poem.", **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": content}], **kw)


# ---- OpenAI API against the real process -------------------------------------------------------


def test_models_health_and_auth(server, client):
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-code-demo-target", "target", "tiny-alias"]  # the directory name, then the aliases
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    assert httpx.get(server.base + "/v1/models").status_code == 401
    r = httpx.post(server.base + "/v1/chat/completions", json={"model": "target", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_chat_stream_equals_complete_with_usage_and_speculative(client):
    full = chat(client)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0
    spec = full.model_extra["speculative"]
    assert set(spec) == {
        "acceptance_length",
        "verify_steps",
        "draft_tokens",
        "accepted_tokens",
        "by_source",
        "controller",
    }
    by_source = spec["by_source"]  # the drafter's blocks and copies of the context, counted apart
    assert set(by_source) == {"dflash", "copy"}
    assert sum(s["drafted"] for s in by_source.values()) == spec["draft_tokens"]
    assert sum(s["accepted"] for s in by_source.values()) == spec["accepted_tokens"]
    assert sum(s["cycles"] for s in by_source.values()) == spec["verify_steps"]
    controller = spec["controller"]  # the break-even controller decides each cycle (plain steps count too)
    assert (
        controller["policy"] == "fixed"
        and sum(controller["tokens_by_mode"].values()) >= full.usage.completion_tokens - 1
    )
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == choice.finish_reason
    assert finals[0].model_extra["speculative"] == spec
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].model_extra["speculative"] == spec


def test_greedy_equals_generate_no_draft(server, client, embedded_pair):
    target, _ = embedded_pair
    prompt = "def fib(n):"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash2_mlx",
            "generate",
            "--model",
            str(target),
            "--no-draft",
            "--json",
            "--prompt",
            prompt,
            "--max-tokens",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout)
    got = chat(client, prompt, max_tokens=40)
    assert got.choices[0].message.content == ref["text"]
    assert got.usage.completion_tokens == len(ref["tokens"])
    assert got.usage.prompt_tokens == ref["prompt_tokens"]


def test_completions_stream_stop_and_default_max_tokens(client):
    kw = dict(model="target", prompt="The quick brown fox", temperature=0)
    full = client.completions.create(max_tokens=32, **kw)
    text = full.choices[0].text
    assert full.object == "text_completion" and full.model_extra["speculative"]["verify_steps"] >= 0
    streamed = list(client.completions.create(max_tokens=32, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    assert streamed[-1].usage.completion_tokens == full.usage.completion_tokens
    # a stop string taken from the greedy output cuts the text right before it
    stop = next(
        (text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isprintable() and text[i : i + 2].strip()),
        None,
    )
    if stop is not None:
        cut = client.completions.create(max_tokens=32, stop=[stop, "\x00never"], **kw)
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    default = client.completions.create(**kw)  # --default-max-tokens 16
    assert default.usage.completion_tokens <= 16
    assert default.choices[0].text == text[: len(default.choices[0].text)]


def test_seed_reproduces_sampled_output(client):
    runs = [
        chat(client, "Tell me a story.", temperature=1.0, top_p=0.95, seed=s, max_tokens=24).choices[0].message.content
        for s in (1234, 1234, 99)
    ]
    assert runs[0] == runs[1]


def test_logprobs_and_penalties(client, embedded_pair):
    r = chat(client, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for entry in lp:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)  # greedy
    # penalties and logit_bias are accepted and applied (a big bias forces the token)
    from mlx_lm.utils import load_tokenizer

    a = load_tokenizer(embedded_pair[0]).encode("A", add_special_tokens=False)[0]
    forced = chat(client, max_tokens=4, logit_bias={str(a): 100}, presence_penalty=0.5, frequency_penalty=0.5)
    assert forced.choices[0].message.content.startswith("A")


def test_anthropic_messages(server):
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)
    # greedy: the embedded pair samples by default, and the two requests must give the same text
    kw = dict(
        model="tiny-alias",
        max_tokens=20,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Hi there"}],
    )
    msg = c.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.output_tokens <= 20 and msg.model_extra["speculative"]["controller"]["policy"] == "fixed"
    text = "".join(b.text for b in msg.content if b.type == "text")
    with c.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == msg.stop_reason
    bad = anthropic.Anthropic(base_url=server.base, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(**kw)
    r = httpx.post(server.base + "/v1/messages", headers={"x-api-key": KEY}, json={"model": "target"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


def _bad_requests():
    """(description, method, path, body bytes or JSON, extra headers) -> each must be a 4xx."""
    ok = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat_cases = {
        "missing model": {k: v for k, v in ok.items() if k != "model"},
        "missing messages": {"model": "target"},
        "empty messages": {**ok, "messages": []},
        "messages not a list": {**ok, "messages": "hi"},
        "message not an object": {**ok, "messages": ["hi"]},
        "role missing": {**ok, "messages": [{"content": "hi"}]},
        "unknown role": {**ok, "messages": [{"role": "robot", "content": "hi"}]},
        "content number": {**ok, "messages": [{"role": "user", "content": 5}]},
        "content object": {**ok, "messages": [{"role": "user", "content": {"a": 1}}]},
        "image part": {
            **ok,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
        "text part without text": {**ok, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "model number": {**ok, "model": 7},
        "unknown model": {**ok, "model": "gpt-4o"},
        "negative max_tokens": {**ok, "max_tokens": -5},
        "zero max_tokens": {**ok, "max_tokens": 0},
        "string max_tokens": {**ok, "max_tokens": "10"},
        "float max_tokens": {**ok, "max_tokens": 1.5},
        "bool max_tokens": {**ok, "max_tokens": True},
        "negative max_completion_tokens": {**ok, "max_completion_tokens": -1},
        "huge temperature": {**ok, "temperature": 1e300},
        "negative temperature": {**ok, "temperature": -0.5},
        "string temperature": {**ok, "temperature": "hot"},
        "top_p above 1": {**ok, "top_p": 1.5},
        "top_k -2": {**ok, "top_k": -2},
        "min_p 1": {**ok, "min_p": 1.0},
        "n 2": {**ok, "n": 2},
        "n 0": {**ok, "n": 0},
        "stop number": {**ok, "stop": 3},
        "too many stops": {**ok, "stop": [str(i) for i in range(40)]},
        "stream string": {**ok, "stream": "yes"},
        "stream_options wrong": {**ok, "stream_options": {"include_usage": "x"}},
        "presence_penalty 5": {**ok, "presence_penalty": 5},
        "frequency_penalty -9": {**ok, "frequency_penalty": -9},
        "logit_bias bad key": {**ok, "logit_bias": {"abc": 1}},
        "logit_bias id outside vocab": {**ok, "logit_bias": {"100000": 1}},
        "logit_bias huge value": {**ok, "logit_bias": {"5": 1000}},
        "top_logprobs without logprobs": {**ok, "top_logprobs": 2},
        "top_logprobs 50": {**ok, "logprobs": True, "top_logprobs": 50},
        "response_format unknown": {**ok, "response_format": {"type": "xml"}},
        "response_format json_schema": {**ok, "response_format": {"type": "json_schema", "json_schema": {}}},
        "tools not a list": {**ok, "tools": {"a": 1}},
        "tool without function": {**ok, "tools": [{"type": "function"}]},
        "tool_choice unknown name": {
            **ok,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice without tools": {**ok, "tool_choice": "required"},
        "reserved template kwarg": {**ok, "chat_template_kwargs": {"tokenize": False}},
        "seed too large": {**ok, "seed": 2**70},
        "seed string": {**ok, "seed": "1"},
        "prompt over the context": {**ok, "messages": [{"role": "user", "content": "x" * (MAX_CONTEXT + 50)}]},
    }
    cases = [(name, "POST", "/v1/chat/completions", body, {}) for name, body in chat_cases.items()]
    comp = {"model": "target", "prompt": "hi", "max_tokens": 4}
    cases += [
        (name, "POST", "/v1/completions", body, {})
        for name, body in {
            "completion prompt missing": {"model": "target"},
            "completion two prompts": {**comp, "prompt": ["a", "b"]},
            "completion empty prompt": {**comp, "prompt": ""},
            "completion token ids outside vocab": {**comp, "prompt": [1, 2, 99999]},
            "completion echo": {**comp, "echo": True},
            "completion best_of": {**comp, "best_of": 3},
            "completion logprobs 99": {**comp, "logprobs": 99},
            "completion prompt over context": {**comp, "prompt": "y" * (MAX_CONTEXT + 10)},
        }.items()
    ]
    cases += [
        ("invalid JSON", "POST", "/v1/chat/completions", b"{not json", {}),
        ("truncated JSON", "POST", "/v1/chat/completions", b'{"model": "target", "messages": [', {}),
        ("NaN literal", "POST", "/v1/chat/completions", b'{"model": "target", "messages": [], "temperature": NaN}', {}),
        ("JSON array body", "POST", "/v1/chat/completions", b"[1, 2, 3]", {}),
        ("JSON string body", "POST", "/v1/chat/completions", b'"hello"', {}),
        ("empty body", "POST", "/v1/chat/completions", b"", {}),
        ("non-UTF-8 bytes", "POST", "/v1/chat/completions", b'{"model": "\xff\xfe"}', {}),
        ("deep nesting", "POST", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, {}),
        (
            "huge integer",
            "POST",
            "/v1/chat/completions",
            b'{"model": "target", "max_tokens": ' + b"9" * 5000 + b"}",
            {},
        ),
        (
            "oversized body",
            "POST",
            "/v1/chat/completions",
            json.dumps({**ok, "messages": [{"role": "user", "content": "z" * (5 * 2**20)}]}).encode(),
            {},
        ),
        ("unknown route", "POST", "/v1/engines/foo", ok, {}),
        ("unknown GET route", "GET", "/v2/models", None, {}),
        ("wrong method", "GET", "/v1/chat/completions", None, {}),
        ("unknown model card", "GET", "/v1/models/nope", None, {}),
        ("missing key", "POST", "/v1/chat/completions", ok, {"Authorization": ""}),
        ("wrong key", "POST", "/v1/chat/completions", ok, {"Authorization": "Bearer nope"}),
        (
            "anthropic missing max_tokens type",
            "POST",
            "/v1/messages",
            {"model": "target", "max_tokens": "x", "messages": [{"role": "user", "content": "hi"}]},
            {"x-api-key": KEY},
        ),
        (
            "anthropic image",
            "POST",
            "/v1/messages",
            {"model": "target", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            {"x-api-key": KEY},
        ),
    ]
    return cases


def test_bad_inputs_get_4xx_and_the_server_keeps_serving(server):
    cases = _bad_requests()
    assert len(cases) >= 50
    with httpx.Client(base_url=server.base, timeout=30) as h:
        for name, method, path, body, headers in cases:
            hdrs = {**auth(), **headers}
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            r = h.request(method, path, content=body, headers={"content-type": "application/json", **hdrs})
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
            err = r.json()
            if path.startswith("/v1/messages"):
                assert err["type"] == "error" and err["error"]["message"], name
            else:
                assert set(err["error"]) == {"message", "type", "param", "code"}, (name, err)
                assert err["error"]["message"], name
            if "over the context" in name:
                assert r.status_code == 400 and err["error"]["code"] == "context_length_exceeded"
            if name == "oversized body":
                assert r.status_code == 413
            if name in ("unknown model", "unknown route", "unknown model card"):
                assert r.status_code == 404
        r = h.post(
            "/v1/chat/completions",
            headers=auth(),
            json={"model": "target", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert httpx.get(server.base + "/health").status_code == 200


def test_queue_full_429_and_disconnect_cancels(server, end_bias):
    # With its end tokens banned, a completion runs until it is cancelled (or reaches the context).
    body = {
        "model": "target",
        "prompt": "class Parser:\n    def __init__(self",
        "max_tokens": 100000,
        "stream": True,
        "logit_bias": end_bias,
    }
    before = labelled(server.base, "dflash2_mlx_generations_total").get('{finish_reason="cancelled"}', 0)
    statuses, together = [], threading.Barrier(6)

    def one(h):
        together.wait(30)  # all six at once, from one client whose connections are already open
        r = h.post("/v1/completions", headers=auth(), json={**body, "stream": False, "max_tokens": 4})
        statuses.append((r.status_code, r.headers.get("retry-after"), r.json()))

    pool = ThreadPoolExecutor(6)
    with httpx.Client(base_url=server.base, timeout=60, limits=httpx.Limits(max_connections=8)) as h:
        with h.stream("POST", "/v1/completions", headers=auth(), json=body) as r:
            assert r.status_code == 200
            # One iterator kept alive: a `for ... break` over r.iter_lines() lets the generator be
            # collected at once, which closes the connection, so the server cancelled the stream
            # (and ran the queued requests) while the six below were still arriving.
            lines, n = r.iter_lines(), 0
            while n < 3:
                n += next(lines).startswith("data:")
            # While it runs, 6 more requests: --max-queue 2 wait, the other 4 get 429 + Retry-After.
            futures = [pool.submit(one, h) for _ in range(6)]
            deadline = time.monotonic() + 30
            while len(statuses) < 4:
                assert time.monotonic() < deadline, statuses
                time.sleep(0.02)
        # A client that disconnects mid-stream cancels its generation within a cycle; the two
        # waiting requests then run.
        for f in futures:
            f.result(60)
    pool.shutdown()
    deadline = time.monotonic() + 10
    while labelled(server.base, "dflash2_mlx_generations_total").get('{finish_reason="cancelled"}', 0) <= before:
        assert time.monotonic() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.05)
    assert sorted(s for s, _, _ in statuses) == [200, 200, 429, 429, 429, 429], statuses
    for status, retry, body_ in statuses:
        if status == 429:
            assert retry and body_["error"]["code"] == "queue_full"
    m = metrics(server.base)
    assert m["dflash2_mlx_queue_depth"] == 0
    text = httpx.get(server.base + "/metrics").text
    for name in (
        "dflash2_mlx_requests_total{",
        "dflash2_mlx_generation_tokens_total",
        "dflash2_mlx_decode_tokens_per_second",
        "dflash2_mlx_cycle_acceptance_length_bucket{",
        "dflash2_mlx_queue_depth",
        'dflash2_mlx_drafted_by_source_total{source="dflash"}',
        'dflash2_mlx_accepted_by_source_total{source="copy"}',
        "dflash2_mlx_copy_index_bytes",
    ):
        assert name in text
    assert m["dflash2_mlx_copy_index_bytes"] > 0  # the answers so far, kept for the key's later requests


def test_sigterm_during_a_stream_ends_it_cleanly(server, end_bias):
    """Last test on the shared server process: it stops it."""
    lines, done = [], threading.Event()

    def reader():
        with httpx.stream(
            "POST",
            server.base + "/v1/completions",
            timeout=60,
            headers=auth(),
            json={
                "model": "target",
                "prompt": "class Parser:\n    def __init__(self",
                "max_tokens": 100000,
                "stream": True,
                "logit_bias": end_bias,
            },
        ) as r:
            for line in r.iter_lines():
                lines.append(line)
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    deadline = time.monotonic() + 30
    while sum(line.startswith("data:") for line in lines) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    code = server.stop(signal.SIGTERM)
    assert done.wait(10)
    assert code == 0, server.log_text()[-2000:]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    final = json.loads(data[-2])
    assert final["choices"][0]["finish_reason"] == "length" and "speculative" in final
    assert "Traceback" not in server.log_text()


# ---- in process: tool calls, reasoning, prefix cache, JSON mode, fuzzing -----------------------


@pytest.fixture(scope="module")
def qwen_dir(tiny_checkpoints, tmp_path_factory):
    return qwen_style_checkpoint(tiny_checkpoints[0], tmp_path_factory.mktemp("qwen") / "qwen-style")


def _app(model, drafter, **kw):
    from fastapi.testclient import TestClient

    from dflash2_mlx.server import ServerConfig, create_app

    kw.setdefault("default_max_tokens", 8)
    app = create_app(ServerConfig(model=str(model), draft_model=str(drafter) if drafter else None, **kw))
    client = TestClient(app, raise_server_exceptions=False)
    client.__enter__()
    assert app.state.worker.ready.wait(60), app.state.worker.error
    return client


@pytest.fixture(scope="module")
def qwen_apps(qwen_dir, tiny_checkpoints):
    """Three servers on the Qwen-style checkpoint: speculative + prefix cache, speculative without
    the cache, plain decoding without the cache."""
    drafter = tiny_checkpoints[1]
    clients = {
        "cached": _app(qwen_dir, drafter, prefix_cache_gb=1, max_context=1024),
        "uncached": _app(qwen_dir, drafter, prefix_cache_gb=0, max_context=1024),
        "plain": _app(qwen_dir, None, prefix_cache_gb=0, max_context=1024),
    }
    yield clients
    for c in clients.values():
        c.__exit__(None, None, None)


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


def _post(client, body, path="/v1/chat/completions"):
    r = client.post(path, json={"model": "qwen-style", "max_tokens": 12, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_tool_calls_are_parsed_by_the_models_tool_parser(qwen_dir):
    from mlx_lm.utils import load_tokenizer

    from dflash2_mlx.server.anthropic.api import MessagesFormatter
    from dflash2_mlx.server.chat import OutputParser
    from dflash2_mlx.server.openai.api import ChatFormatter
    from dflash2_mlx.server.stream import Accumulator

    tok = load_tokenizer(qwen_dir, eos_token_ids=[298])
    assert tok.has_tool_calling and tok.has_thinking
    text = (
        'The user wants weather.</think>\n\nChecking.<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>'
    )

    class Event:
        def __init__(self, t, finish=None):
            self.tokens, self.text, self.stats, self.finish_reason, self.logprobs = [1], t, None, finish, None

    for fmt_cls in (ChatFormatter, MessagesFormatter):
        acc = Accumulator(tok, 10, OutputParser(tok, "reasoning", TOOLS))
        fmt = fmt_cls(acc, "m")
        chunks = fmt.start()
        for i in range(0, len(text), 3):  # the text arrives in small pieces, markers split across them
            piece = text[i : i + 3]
            event = Event(piece, "stop" if i + 3 >= len(text) else None)
            chunks += fmt.event(event, acc.add(event))
        chunks += fmt.end([])
        assert acc.reasoning == "The user wants weather." and acc.content == "Checking."
        assert acc.tool_calls and acc.tool_calls[0]["name"] == "get_weather"
        assert json.loads(acc.tool_calls[0]["arguments"]) == {"city": "Paris"}
        body = fmt.body()
        stream = b"".join(chunks).decode()
        if fmt_cls is ChatFormatter:
            assert body["choices"][0]["finish_reason"] == "tool_calls"
            call = body["choices"][0]["message"]["tool_calls"][0]
            assert call["type"] == "function" and call["function"]["name"] == "get_weather"
            assert body["choices"][0]["message"]["reasoning_content"] == "The user wants weather."
            assert '"tool_calls": [{"index": 0' in stream and '"finish_reason": "tool_calls"' in stream
        else:
            assert body["stop_reason"] == "tool_use"
            assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
            assert body["content"][2]["input"] == {"city": "Paris"}
            assert "input_json_delta" in stream and "thinking_delta" in stream
    # a call whose name cannot be read is dropped: its markup never becomes the answer's text
    acc = Accumulator(tok, 1, OutputParser(tok, "normal", TOOLS))
    acc.add(Event("<tool_call>{broken</tool_call>", "stop"))
    assert acc.tool_calls == [] and acc.content == ""


def test_tools_render_through_the_template_and_reasoning_is_split(qwen_apps):
    c = qwen_apps["cached"]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = _post(c, {"messages": msgs})
    with_tools = _post(c, {"messages": msgs, "tools": TOOLS, "tool_choice": "auto"})
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50  # tools rendered
    none = _post(c, {"messages": msgs, "tools": TOOLS, "tool_choice": "none"})
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    # The template opens <think>: with </think> banned, every token is reasoning.
    r = _post(c, {"messages": msgs, "logit_bias": {str(END_THINK): -100}})
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] in (None, "")
    off = _post(c, {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    assert off["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 4  # "\n\n</think>\n\n" closes it
    assert "reasoning_content" not in off["choices"][0]["message"]
    # Anthropic: tools and a tool_result round trip render and answer
    r = c.post(
        "/v1/messages",
        json={
            "model": "qwen-style",
            "max_tokens": 6,
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
            ],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 60


def test_prefix_cache_gives_identical_results(qwen_apps):
    """A multi-turn conversation through the thinking template: turn 2 reuses turn 1's message
    boundary snapshots; outputs equal the uncached speculative and the plain decoder's."""
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    outs = {}
    for name, c in qwen_apps.items():
        first = _post(c, {"messages": turn1, "max_tokens": 10})
        reply = first["choices"][0]["message"]
        turn2 = turn1 + [
            {
                "role": "assistant",
                "content": reply.get("content") or "blue",
                "reasoning_content": reply.get("reasoning_content"),
            },
            {"role": "user", "content": "Another one?"},
        ]
        second = _post(c, {"messages": turn2, "max_tokens": 10})
        third = _post(c, {"messages": turn2, "max_tokens": 10})  # the same prompt again: full prefix hit
        outs[name] = [(r["choices"][0]["message"], r["usage"]["completion_tokens"]) for r in (first, second, third)]
        if name == "cached":
            # turn 2 reuses everything up to the end of turn 1's user message (the snapshot at that
            # message boundary), not only the system prompt; 13 = "<|im_start|>assistant\n<think>\n"
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 13
            assert (
                third["usage"]["prompt_tokens_details"]["cached_tokens"]
                >= second["usage"]["prompt_tokens_details"]["cached_tokens"]
            )
        else:
            assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert outs["cached"] == outs["uncached"] == outs["plain"]
    text = c.get("/metrics").text
    assert "dflash2_mlx_prefix_cache_bytes" in text


def test_json_mode_constrains_output(qwen_apps):
    msgs = [{"role": "user", "content": "Reply in JSON."}]
    kw = {
        "messages": msgs,
        "response_format": {"type": "json_object"},
        "max_tokens": 40,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    spec = _post(qwen_apps["uncached"], kw)
    plain = _post(qwen_apps["plain"], kw)
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]  # lossless with the grammar on
    text = spec["choices"][0]["message"]["content"]
    assert text.startswith("{")
    if spec["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    sampled = _post(qwen_apps["uncached"], {**kw, "temperature": 1.0, "seed": 3})
    assert sampled["choices"][0]["message"]["content"].startswith("{")


def test_fuzzed_requests_never_get_a_500(qwen_apps):
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    c = qwen_apps["plain"]
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=False),
        st.text(max_size=20),
    )
    nested = st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=8,
    )
    plausible = st.one_of(
        st.integers(-3, 40),
        st.floats(-1, 3),
        st.booleans(),
        st.text(max_size=5),
        st.sampled_from(
            [
                "auto",
                "none",
                "required",
                "qwen-style",
                {"type": "json_object"},
                {"include_usage": True},
                {"type": "enabled"},
                ["a", "b"],
                {"65": 5},
            ]
        ),
    )
    values = st.one_of(plausible, nested)
    fields = [
        "model",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "chat_template_kwargs",
        "prompt",
        "max_completion_tokens",
        "system",
        "stop_sequences",
        "thinking",
    ]
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
            "content": st.one_of(st.text(max_size=30), values),
        }
    )
    base = {"model": "qwen-style", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 3}
    seen: dict[int, int] = {}

    # Valid requests of each route, run besides the generated ones: how many of those a generator
    # makes valid depends on its draws (4 or 5 of 50 here), and generation must run either way.
    @example(path="/v1/chat/completions", changes={}, messages=None, raw=None)
    @example(path="/v1/completions", changes={}, messages=None, raw=None)
    @example(path="/v1/messages", changes={}, messages=None, raw=None)
    @example(path="/v1/chat/completions", changes={"temperature": 0.5, "seed": 1}, messages=None, raw=None)
    @example(path="/v1/messages", changes={"stop_sequences": ["x"]}, messages=None, raw=None)
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages"]),
        changes=st.dictionaries(st.sampled_from(fields), values, max_size=4),
        messages=st.one_of(st.none(), st.lists(message, max_size=3)),
        raw=st.one_of(st.none(), st.binary(max_size=40)),
    )
    def check(path, changes, messages, raw):
        body = {**base, **changes}
        if messages is not None:
            body["messages"] = messages
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
            body["max_tokens"] = min(body["max_tokens"], 4)  # valid requests stay quick
        content = raw if raw is not None else json.dumps(body).encode()
        r = c.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text[:300], body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code != 200:
            err = r.json()
            if path == "/v1/messages":
                assert err["type"] == "error" and err["error"]["message"]
            else:
                assert set(err["error"]) == {"message", "type", "param", "code"}

    check()
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 10, seen  # both generation and rejection ran
    assert c.get("/health").status_code == 200


def test_loading_503_timeouts_and_internal_errors(tiny_checkpoints, monkeypatch):
    """503 while loading; a generation cut short by --request-timeout ends as "length"; a request
    still queued at its deadline gets a 503; an unexpected failure is a 500 naming the request id."""
    from fastapi.testclient import TestClient

    from dflash2_mlx.models.loading import load_target
    from dflash2_mlx.server import ServerConfig, create_app
    from dflash2_mlx.server import params as params_module
    from dflash2_mlx.server.worker import Job, Worker

    target = tiny_checkpoints[0]
    gate = threading.Event()
    worker = Worker(
        str(target),
        None,
        max_queue=4,
        max_concurrent=1,
        max_context=4096,
        prefix_cache_bytes=0,
        loader=lambda: (gate.wait(60), load_target(str(target)))[1:] + (None,),
    )
    app = create_app(ServerConfig(model=str(target), request_timeout=1.0), worker)
    body = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/health").status_code == 503 and c.get("/health").json()["status"] == "loading"
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"]
        gate.set()
        assert worker.ready.wait(60)
        # The timeout, not an end token or the context, must end this answer, on any machine: ban
        # the end tokens and pace the decode to one event (one token: no drafter) per 50 ms.
        end_bias = {str(t): -100 for t in worker.tokenizer.eos_token_ids}
        emit = Job.emit

        def paced_emit(job, kind, payload=None):
            if kind == "event":
                time.sleep(0.05)
            emit(job, kind, payload)

        with monkeypatch.context() as m:
            m.setattr(Job, "emit", paced_emit)
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json={**body, "logit_bias": end_bias})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert 0 < r.json()["usage"]["completion_tokens"] <= 1.0 / 0.05 + 2 and time.monotonic() - t0 < 10
        # the worker (one request at a time) busy for 2.5 s: a second request times out in the queue
        real_admit = worker._admit

        def slow_admit(job):
            time.sleep(2.5)
            return real_admit(job)

        monkeypatch.setattr(worker, "_admit", slow_admit)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(c.post, "/v1/chat/completions", json={**body, "max_tokens": 2})
            time.sleep(0.3)
            second = pool.submit(c.post, "/v1/chat/completions", json={**body, "max_tokens": 2})
            r2 = second.result(30)
            assert r2.status_code == 503 and r2.json()["error"]["code"] == "queue_timeout", r2.text
            assert first.result(30).status_code == 200
        monkeypatch.setattr(worker, "_admit", real_admit)

        def boom(*a, **k):
            raise RuntimeError("boom")

        monkeypatch.setattr(params_module, "to_settings", boom)
        r = c.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 500 and r.headers["x-request-id"] in r.json()["error"]["message"]
        monkeypatch.undo()
        assert c.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_cors_is_off_by_default_and_on_for_allowed_origins(tiny_checkpoints):
    from fastapi.testclient import TestClient

    from dflash2_mlx.server import ServerConfig, create_app

    target = str(tiny_checkpoints[0])
    preflight = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    for origins, allowed in (((), False), (("http://localhost:3000",), True)):
        c = TestClient(create_app(ServerConfig(model=target, allowed_origins=origins)))  # no lifespan: not loaded
        r = c.options("/v1/chat/completions", headers=preflight)
        assert (r.headers.get("access-control-allow-origin") == "http://localhost:3000") is allowed
        r = c.get("/health", headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert ("access-control-allow-origin" in r.headers) is allowed
        r = c.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_default_max_tokens_is_the_models_generation_config_unless_the_server_sets_one(tiny_checkpoints, tmp_path):
    import shutil

    model = shutil.copytree(tiny_checkpoints[0], tmp_path / "target")
    config_file = model / "generation_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config_file.write_text(json.dumps({**config, "max_new_tokens": 5}))
    for server_default, expected in ((None, 5), (3, 3)):
        c = _app(model, None, prefix_cache_gb=0, default_max_tokens=server_default)
        try:
            no_end = {str(t): -100 for t in c.app.state.worker.tokenizer.eos_token_ids}  # never stops early
            r = c.post(
                "/v1/completions", json={"model": "target", "prompt": "abc", "temperature": 0, "logit_bias": no_end}
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == expected
            assert r.json()["choices"][0]["finish_reason"] == "length"
        finally:
            c.__exit__(None, None, None)
