"""The persistent prompt cache through real `serve` processes: a restart restores a long system
prompt from disk with the same answer, and a `kill -9` while snapshots are written leaves a
directory the next server repairs and serves from."""

from __future__ import annotations

import hashlib
import json
import signal

import httpx
from server_helpers import metrics, running_server

NO_EOS = {"0": -100, "2": -100}


def _system_prompt(target, n_tokens: int) -> str:
    """Code-like text of about ``n_tokens`` tokens for the embedded tokenizer."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(target)
    words = ["def", "return", "value", "index", "items", "result", "for", "in", "range", "if", "else", "class"]
    text, i = "You review Python code. Conventions:\n", 0
    while len(tok.encode(text, add_special_tokens=False)) < n_tokens:
        text += f"{words[i % len(words)]}_{i % 97} = {words[(i * 7) % len(words)]}({i % 13})\n"
        i += 1
    return text


def _args(pair, cache_dir) -> list[str]:
    target, drafter = pair
    return [
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--prompt-cache-dir",
        str(cache_dir),
        "--request-timeout",
        "300",
    ]


def _chat(base: str, system: str, user: str, max_tokens: int = 24) -> dict:
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(
        base + "/v1/chat/completions",
        timeout=300,
        json={
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def _consistent(root) -> dict:
    index = json.loads((root / "index.json").read_text())["entries"]
    files = {p.name for p in (root / "snapshots").iterdir()}
    assert files == {e["file"] for e in index.values()}, (files, index)
    for e in index.values():
        assert hashlib.sha256((root / "snapshots" / e["file"]).read_bytes()).hexdigest() == e["sha256"]
    return index


def test_after_a_restart_a_long_system_prompt_is_restored_from_disk_with_the_same_answer(embedded_pair, tmp_path):
    cache_dir = tmp_path / "prompt-cache"
    system = _system_prompt(embedded_pair[0], 1500)
    with running_server(_args(embedded_pair, cache_dir), tmp_path / "first.log") as srv:
        first = _chat(srv.base, system, "Review: def f(x): return x")  # nothing cached yet: the reference
    assert first["usage"]["prompt_tokens"] >= 1500 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (cache_dir / "index.json").exists()  # SIGTERM: queued snapshots were written before exit
    with running_server(_args(embedded_pair, cache_dir), tmp_path / "second.log") as srv:
        # another conversation with the same system prompt: the system-message snapshot
        other = _chat(srv.base, system, "Review: class A: pass")
        again = _chat(srv.base, system, "Review: def f(x): return x")
        m = metrics(srv.base)
        anthropic = httpx.post(
            srv.base + "/v1/messages",
            timeout=300,
            json={
                "model": httpx.get(srv.base + "/v1/models", timeout=10).json()["data"][0]["id"],
                "max_tokens": 8,
                "system": system,
                "messages": [{"role": "user", "content": "Review: 1"}],
            },
        )
    prompt = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.8 * prompt
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.8 * other["usage"]["prompt_tokens"]
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert m["dflash2_mlx_prefix_cache_disk_hits_total"] >= 1
    assert anthropic.status_code == 200, anthropic.text
    usage = anthropic.json()["usage"]
    assert usage["cache_read_input_tokens"] >= 0.8 * usage["input_tokens"]
    _consistent(cache_dir)


def test_kill_9_while_snapshots_are_written_leaves_a_cache_the_next_server_repairs_and_uses(embedded_pair, tmp_path):
    cache_dir = tmp_path / "prompt-cache"
    system = _system_prompt(embedded_pair[0], 800)
    users = [f"Review item {i}: def g{i}(y): return y * {i}" for i in range(6)]
    answers = {}
    for round_ in range(2):  # killed right after its answers, while their snapshots are being written
        with running_server(_args(embedded_pair, cache_dir), tmp_path / f"killed-{round_}.log") as srv:
            for user in users[round_ * 3 : round_ * 3 + 3]:
                answers[user] = _chat(srv.base, system, user, max_tokens=12)["choices"][0]["message"]
            srv.stop(signal.SIGKILL)
    with running_server(_args(embedded_pair, cache_dir), tmp_path / "after.log") as srv:
        index = _consistent(cache_dir)  # the new server repaired the directory at start-up
        assert not [p for p in (cache_dir / "snapshots").iterdir() if p.name.endswith(".tmp")]
        for user in users:
            got = _chat(srv.base, system, user, max_tokens=12)
            assert got["choices"][0]["message"] == answers[user]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert "Traceback" not in srv.log_text()
    assert index is not None
    _consistent(cache_dir)
