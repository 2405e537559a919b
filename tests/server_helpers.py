"""Helpers for the server tests and benchmarks: a real `serve` process on a free loopback port, and
a copy of the tiny target with a Qwen-style chat template (thinking blocks and tool calls)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx

THINK, END_THINK, TOOL_CALL, END_TOOL_CALL = 290, 291, 292, 293

# A reduced Qwen3 template: tools in the system turn, <tool_call> JSON, tool responses as user turns,
# reasoning kept only on the last assistant turn, and an opened <think> block in the generation
# prompt unless enable_thinking is false (as Qwen3.5 templates do).
QWEN_STYLE_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content and loop.last %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}{% if m.tool_calls %}{% for tool_call in m.tool_calls %}{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


def qwen_style_checkpoint(target: Path, dest: Path) -> Path:
    """The tiny target (same weights) with <think>, </think>, <tool_call>, </tool_call> tokens (ids
    290..293, formerly unused) and the Qwen-style template: mlx-lm then infers thinking support and
    its json_tools tool parser, as for a real Qwen model."""
    from tokenizers import Tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(target / "config.json", dest / "config.json")
    link = dest / "model.safetensors"
    if not link.exists():
        os.symlink(target / "model.safetensors", link)
    tok = json.loads((target / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    names = {THINK: "<think>", END_THINK: "</think>", TOOL_CALL: "<tool_call>", END_TOOL_CALL: "</tool_call>"}
    for old in [k for k, v in vocab.items() if v in names]:
        del vocab[old]
    for i, name in names.items():
        vocab[name] = i
    (dest / "tokenizer.json").write_text(json.dumps(tok))
    t = Tokenizer.from_file(str(dest / "tokenizer.json"))
    t.add_tokens(list(names.values()))
    t.save(str(dest / "tokenizer.json"))
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_STYLE_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash2_mlx", "serve", *args]


@contextlib.contextmanager
def running_server(
    args: list[str], log: Path, port: Optional[int] = None, wait: float = 90.0, nice: bool = True
) -> Iterator[ServerProcess]:
    """A `dflash2-mlx serve` process (stderr to ``log``), yielded once /health answers 200."""
    port = port or free_port()
    cmd = serve_command(*args, "--host", "127.0.0.1", "--port", str(port))
    if nice:
        cmd = ["nice", "-n", "19", *cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("DFLASH2_PROMPT_CACHE_DIR", "none")  # benchmarks too: pass --prompt-cache-dir to use one
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, log)
    try:
        deadline = time.monotonic() + wait
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_text()[-3000:]}")
            try:
                if httpx.get(server.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not become ready:\n{server.log_text()[-3000:]}")
            time.sleep(0.2)
        yield server
    finally:
        server.stop()


def metrics(base: str, headers: Optional[dict] = None) -> dict[str, float]:
    from dflash2_mlx.server.metrics import parse

    return parse(httpx.get(base + "/metrics", headers=headers, timeout=10).text)


def labelled(base: str, name: str) -> dict[str, float]:
    """Samples of a labelled metric: label text -> value."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) :].rpartition(" ")
            out[labels] = float(value)
    return out
