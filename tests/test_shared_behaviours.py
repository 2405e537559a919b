"""Behaviours `chat` and `serve` share: one implementation each, so the two front ends agree.

Generation defaults (generation_config.json), the message boundaries where the prefix cache stores
snapshots, and the reasoning split at the tokenizer's own tags.
"""

from __future__ import annotations

import io
import json

import pytest
from server_helpers import THINK, qwen_style_checkpoint

from dflash2_mlx.models.generation_config import generation_defaults

# A Qwen3.5-style thinking template: the generation prompt opens a think block, and an answer's
# reasoning is rendered only while no user message follows it (later prompts re-render the
# answer without it).
THINKING_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query %}<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi", "reasoning_content": "greet back"},
    {"role": "user", "content": "and then?"},
    {"role": "assistant", "content": "then this", "reasoning_content": "continue"},
    {"role": "user", "content": "and finally?"},
]


# ---- generation_config.json ----------------------------------------------------------------------


def _model_dir(tmp_path, config, name: str = "model") -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(tmp_path / name)


def test_generation_defaults_are_the_files_sampling_settings_and_answer_length(tmp_path):
    d = generation_defaults(
        _model_dir(
            tmp_path,
            {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_new_tokens": 300},
        )
    )
    assert d == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_new_tokens": 300}


def test_generation_defaults_with_do_sample_false_are_greedy_and_keep_the_answer_length(tmp_path):
    d = generation_defaults(_model_dir(tmp_path, {"do_sample": False, "temperature": 0.6, "max_new_tokens": 9}))
    assert d == {"temperature": 0.0, "max_new_tokens": 9}


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"greedy"', "{not json"])
def test_a_generation_config_that_is_not_a_json_object_gives_no_defaults(tmp_path, text):
    # (chat crashed on a JSON list while the server ignored it)
    assert generation_defaults(_model_dir(tmp_path, text)) == {}
    assert generation_defaults(tmp_path / "no-such-model") == {}


def test_generation_defaults_drop_values_the_sampler_would_refuse_so_chat_and_requests_still_run(tmp_path):
    from dflash2_mlx.cli.common import chat_sampling
    from dflash2_mlx.server.params import build_params

    bad = {"temperature": -1, "top_p": 0, "top_k": -1, "min_p": 1.5, "max_new_tokens": True}
    model = _model_dir(tmp_path, {**bad, "top_k": 2.5})
    assert generation_defaults(model) == {}
    assert generation_defaults(_model_dir(tmp_path, {"top_k": 40.0, "top_p": True}, "other")) == {"top_k": 40}
    # chat starts (the user gave no sampling option) and a request without sampling fields is taken
    assert chat_sampling(model, None, None, None, None).greedy
    request = type("Request", (), {})()
    params = build_params(request, max_tokens=8, vocab_size=300, defaults=generation_defaults(model))
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 1.0, 0, 0.0)


# ---- message boundaries with a thinking template ------------------------------------------------


@pytest.fixture(scope="module")
def qwen_target(tiny_checkpoints, tmp_path_factory):
    """The tiny target with <think>/</think> tokens and the Qwen3.5-style thinking template."""
    from dflash2_mlx.models.loading import load_target

    qwen = qwen_style_checkpoint(tiny_checkpoints[0], tmp_path_factory.mktemp("qwen") / "target")
    cfg = json.loads((qwen / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (qwen / "tokenizer_config.json").write_text(json.dumps(cfg))
    # greedy, with a top_k the sampler refuses (vLLM's -1): chat and the server must both start
    (qwen / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": -1, "max_new_tokens": 5}))
    return load_target(str(qwen))


def _chat_session(target):
    from rich.console import Console

    from dflash2_mlx.cli.chat_session import ChatSession
    from dflash2_mlx.engine import GenerationSettings

    return ChatSession(
        target,
        None,
        GenerationSettings(max_tokens=4),
        Console(file=io.StringIO()),
        None,
        None,
        False,
        2**20,
        "qwen-style",
    )


def test_chat_and_serve_store_prompt_cache_snapshots_at_the_same_message_boundaries(qwen_target):
    from dflash2_mlx.server.chat import render_chat

    tok = qwen_target.tokenizer
    session = _chat_session(qwen_target)
    session.system, session.messages = CONVERSATION[0]["content"], CONVERSATION[1:]
    chat_ids, chat_save_at = session.encode()
    served = render_chat(tok, CONVERSATION, None, {})
    assert served.ids == chat_ids
    assert served.save_at == chat_save_at

    def rendered(messages, **kwargs):
        return tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, **kwargs)

    # every boundary is a prefix of this prompt, hence of the next turn's prompt
    end_of_last_user = len(rendered(CONVERSATION))
    assert end_of_last_user in chat_save_at
    # the last answer as rendered alone carries its reasoning; in this prompt it does not: the
    # boundary is where the two agree, the start of that answer (after "<|im_start|>assistant\n")
    alone = rendered(CONVERSATION[:5])
    assert chat_ids[: len(alone)] != alone
    start_of_answer = len(rendered(CONVERSATION[:4])) + len(
        tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    )
    assert start_of_answer in chat_save_at
    assert all(0 < n < len(chat_ids) for n in chat_save_at)


def test_chat_and_a_server_on_one_model_read_the_same_defaults_and_store_the_same_snapshots(qwen_target):
    """End to end, plain decoding (the save positions are the same with a drafter): both read the
    model's defaults alike, and the chat's session cache and the server's prefix cache hold
    snapshots of the same token prefixes."""
    from fastapi.testclient import TestClient

    from dflash2_mlx.cli.common import chat_sampling
    from dflash2_mlx.server import ServerConfig, create_app

    assert generation_defaults(qwen_target.path) == {"temperature": 0.0, "max_new_tokens": 5}
    assert chat_sampling(qwen_target.path, None, None, None, None).greedy
    session = _chat_session(qwen_target)
    session.system, session.messages = CONVERSATION[0]["content"], CONVERSATION[1:-1]
    assert session.answer(CONVERSATION[-1]["content"]) is not None
    chat_prefixes = set(session.cache._entries)

    app = create_app(ServerConfig(model=str(qwen_target.path), prefix_cache_gb=1, prompt_cache_dir=None))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert app.state.worker.ready.wait(60), app.state.worker.error
        assert app.state.worker.defaults == generation_defaults(qwen_target.path)
        r = client.post("/v1/chat/completions", json={"model": "target", "messages": CONVERSATION, "max_tokens": 4})
        assert r.status_code == 200, r.text
        served_prefixes = set(app.state.worker.prefix_cache._entries)
    assert len(chat_prefixes) >= 3  # the prompt and at least two message boundaries
    assert served_prefixes == chat_prefixes


def test_the_next_turns_prompt_extends_every_boundary_stored_for_this_one(qwen_target):
    from dflash2_mlx.server.chat import render_chat

    tok = qwen_target.tokenizer
    this = render_chat(tok, CONVERSATION, None, {})
    following = CONVERSATION + [
        {"role": "assistant", "content": "done", "reasoning_content": "wrap up"},
        {"role": "user", "content": "thanks"},
    ]
    nxt = render_chat(tok, following, None, {})
    assert this.save_at and all(nxt.ids[:n] == this.ids[:n] for n in this.save_at)


# ---- the reasoning split ------------------------------------------------------------------------


def test_chat_splits_reasoning_at_the_tokenizers_own_tags_and_starts_where_the_server_does(qwen_target):
    from dflash2_mlx.server.chat import render_chat
    from dflash2_mlx.text.reasoning import reasoning_tags

    tok = qwen_target.tokenizer
    session = _chat_session(qwen_target)
    assert session.tags == reasoning_tags(tok) == ("<think>", "</think>")
    session.messages = [{"role": "user", "content": "hello"}]
    ids, _ = session.encode()
    assert ids[-2] == THINK  # the generation prompt opened the block
    assert render_chat(tok, session.conversation(), None, {}).initial_state == "reasoning"


def test_a_model_without_reasoning_tags_answers_in_plain_text_in_chat_as_in_the_server(tiny_checkpoints):
    from dflash2_mlx.cli.think_splitter import ThinkSplitter
    from dflash2_mlx.models.loading import load_target
    from dflash2_mlx.server.chat import OutputParser
    from dflash2_mlx.text.reasoning import reasoning_tags

    tok = load_target(str(tiny_checkpoints[0])).tokenizer
    assert reasoning_tags(tok) is None
    text = "<think>not a tag for this model</think> answer"
    pieces = ThinkSplitter(reasoning_tags(tok)).feed(text, final=True)
    assert pieces == [(False, text)]
    parser = OutputParser(tok)
    deltas = parser.feed(text) + parser.finish()
    assert [(d.kind, d.text) for d in deltas] == [("content", text)]
