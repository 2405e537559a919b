"""`dflash2-mlx chat` driven through a pseudo-terminal, as a person uses it."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

STATS = re.compile(
    r"(\d+) tokens · [\d.]+ tok/s · acceptance [\d.]+ · first token [\d.]+ m?s · "
    r"prompt (\d+) \((\d+) prefilled, (\d+) cached\)"
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _as_a_terminal_starts_it():
    # A shell gives a command it runs in the foreground the default Ctrl-C; a suite started from a
    # background job (nohup, `cmd &`) has SIGINT ignored, which the chat would inherit and honour.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args, timeout=90):
    env = dict(os.environ, TERM="xterm", COLUMNS="120", LINES="40", PYTHONUNBUFFERED="1")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "dflash2_mlx", "chat", *args],
        env=env,
        encoding="utf-8",
        timeout=timeout,
        dimensions=(40, 120),
        preexec_fn=_as_a_terminal_starts_it,
    )
    child.expect_exact(">>> ")
    return child


def turn(child, *lines):
    """Send one message (several lines = continuation lines) and return its stats line's numbers."""
    for line in lines:
        child.sendline(line)
    child.expect(STATS)
    generated, prompt, prefilled, cached = map(int, child.match.groups())
    child.expect_exact(">>> ")
    return {"generated": generated, "prompt": prompt, "prefilled": prefilled, "cached": cached}


def command(child, line):
    child.sendline(line)
    child.expect_exact(">>> ")
    return ANSI.sub("", child.before)


def template_lengths(target: Path, messages: list[dict]) -> list[int]:
    """Token count of the prompt before each assistant answer (user turns + generation prompt)."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(target)
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "user":
            out.append(len(tok.apply_chat_template(messages[: i + 1], add_generation_prompt=True, tokenize=True)))
    return out


@pytest.fixture
def endless_pair(embedded_pair, tmp_path):
    """The embedded pair with its target's end tokens moved to the drafter's mask token, which the
    target never predicts: its answers never end by themselves, whatever the weights (a test that
    needs an answer to run until it is stopped must not rely on a model happening not to stop)."""
    import shutil

    target, drafter = embedded_pair
    copy = tmp_path / "endless-target"
    shutil.copytree(target, copy)
    mask = json.loads((Path(drafter) / "config.json").read_text())["dflash_config"]["mask_token_id"]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((copy / name).read_text())
        cfg["eos_token_id"] = [mask]
        cfg.get("text_config", {})["eos_token_id"] = mask
        (copy / name).write_text(json.dumps(cfg))
    return ["--model", str(copy), "--draft-model", str(drafter)]


def test_two_turns_prefill_only_new_tokens_and_save_load(embedded_pair, endless_pair, tmp_path):
    target, _ = embedded_pair
    # answers that never end, so the 16-token answer does not close its turn and the cached
    # prefix of the next turn is exactly the previous prompt (a closed turn is cached with it)
    child = spawn(*endless_pair, "--max-tokens", "16", "--temp", "0")
    try:
        first = turn(child, "hello")
        assert first["cached"] == 0 and first["prefilled"] == first["prompt"]
        assert 0 < first["generated"] <= 16
        # a two-line message through a trailing backslash
        second = turn(child, "tell me\\", "more")
        saved = tmp_path / "a.json"
        out = command(child, f"/save {saved}")
        assert "saved 4 messages" in out
        conv = json.loads(saved.read_text())
        messages = conv["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[2]["content"] == "tell me\nmore"
        p1, p2 = template_lengths(target, messages)
        assert (first["prompt"], second["prompt"]) == (p1, p2)
        # The second turn restored the first prompt from the prefix cache and prefilled only the rest.
        assert second["cached"] == p1 and second["prefilled"] == p2 - p1

        stats = command(child, "/stats")
        assert "prefilled" in stats and "prefix cache:" in stats and "1 hits" in stats

        # /clear, then /load the saved conversation: the next turn extends it (and its cache).
        assert "conversation cleared" in command(child, "/clear")
        assert "loaded 4 messages" in command(child, f"/load {saved}")
        third = turn(child, '"""', "line one", "line two", '"""')
        assert third["cached"] == p2 and third["prefilled"] == third["prompt"] - p2
        again = tmp_path / "b.json"
        command(child, f"/save {again}")
        conv2 = json.loads(again.read_text())
        assert conv2["messages"][:4] == messages
        assert conv2["messages"][4] == {"role": "user", "content": "line one\nline two"}

        # system prompt: set, shown, used by the template (the prompt changes, so nothing is cached)
        command(child, "/system You are terse.")
        assert "You are terse." in command(child, "/system")
        fourth = turn(child, "hi")
        assert fourth["cached"] == 0 and fourth["prefilled"] == fourth["prompt"]
        assert "unknown command" in command(child, "/bogus")
        assert "/save FILE" in command(child, "/help")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(endless_pair):
    child = spawn(*endless_pair, "--max-tokens", "100000", "--temp", "0")
    try:
        child.sendline("write forever")
        child.expect_exact("write forever")  # the terminal's echo
        child.expect(r"\S", timeout=60)  # the answer has started streaming
        child.sendintr()  # Ctrl-C
        child.expect_exact("[stopped]")
        child.expect(STATS)
        generated = int(child.match.group(1))
        assert 0 < generated < 100000
        child.expect_exact(">>> ")
        # Ctrl-C at the prompt clears the input instead of leaving. Type after a human pause:
        # readline flushes input that arrives while it is still setting up the terminal.
        time.sleep(0.5)
        child.send("half a line")
        child.sendintr()
        child.expect_exact("input cleared")
        child.expect_exact(">>> ")
        # the chat accepts the next message, and it extends the interrupted conversation
        time.sleep(0.5)
        child.sendline("again")
        child.expect_exact("again")
        child.expect(r"\S", timeout=60)
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect(STATS)
        assert int(child.match.group(4)) > 0  # the first prompt came from the prefix cache
        child.expect_exact(">>> ")
        stats = command(child, "/stats")
        assert stats.count("cancelled") == 2
        child.sendeof()  # Ctrl-D leaves
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_think_splitter_streams_reasoning_and_answer():
    from dflash2_mlx.cli.think_splitter import ThinkSplitter

    split = ThinkSplitter(("<think>", "</think>"))
    pieces = []
    for chunk in ["Hm <thi", "nk>reason", "ing</th", "ink>\n\nThe answer", ""]:
        pieces += split.feed(chunk, final=chunk == "")
    think = "".join(t for r, t in pieces if r)
    answer = "".join(t for r, t in pieces if not r)
    assert think == "reasoning"
    assert answer == "Hm \n\nThe answer"
    # a template that opens the think block in the prompt: the output starts inside it
    split = ThinkSplitter(("<think>", "</think>"), in_think=True)
    pieces = split.feed("plan</think>done", final=True)
    assert [(r, t) for r, t in pieces if t] == [(True, "plan"), (False, "done")]


def test_chat_bad_arguments_are_one_line(tiny_checkpoints, capsys, monkeypatch):
    from dflash2_mlx.cli.app import main

    target, drafter = tiny_checkpoints

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["dflash2-mlx", "chat", *args])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        lines = [l for l in err.strip().splitlines() if l.strip()]
        assert e.value.code != 0 and len(lines) == 1 and lines[0].startswith("error:"), err
        return lines[0]

    assert "--draft-model" in run("--model", str(target))
    assert "preset" in run("--preset", "nope")
    assert "exclusive" in run("--preset", "qwen3.8-27b", "--model", str(target))
    assert "max-tokens" in run("--model", str(target), "--no-draft", "--max-tokens", "0")
    assert "No such option" in run("--bogus")
    assert "does not exist" in run("--model", "/nonexistent/dir", "--no-draft")


# A Qwen3.5-style thinking template: the generation prompt opens a think block (closed at once when
# thinking is off), and earlier assistant turns are re-rendered without their reasoning. So the
# prompt of turn 2 does not extend the prompt of turn 1: only the message boundary after the first
# user message (passed as save_at) is shared.
QWEN_STYLE_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}\n</think>\n\n{% endif %}"
    "{% endif %}"
)


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_reuses_message_boundaries_with_a_thinking_template(tiny_checkpoints, tmp_path, thinking):
    import io

    from rich.console import Console
    from server_helpers import qwen_style_checkpoint

    from dflash2_mlx.cli.chat_session import ChatSession
    from dflash2_mlx.engine import GenerationSettings
    from dflash2_mlx.models.loading import load_drafter, load_target

    target_dir, drafter_dir = tiny_checkpoints
    # <think> and </think> are tokens of its vocabulary, as in a real Qwen tokenizer: the chat splits
    # reasoning at the tokenizer's own tags only
    qwen = qwen_style_checkpoint(target_dir, tmp_path / "qwen-style")
    cfg = json.loads((qwen / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_STYLE_TEMPLATE
    (qwen / "tokenizer_config.json").write_text(json.dumps(cfg))
    target, drafter = load_target(str(qwen)), load_drafter(str(drafter_dir))
    tok = target.tokenizer
    out = io.StringIO()
    session = ChatSession(
        target,
        drafter,
        GenerationSettings(max_tokens=12, stop_token_ids=sorted(tok.eos_token_ids)),
        Console(file=out, width=100),
        None,
        thinking,
        False,
        2**30,
        "qwen-style",
    )
    first = session.answer("hello")
    second = session.answer("and then?")
    kwargs = {"enable_thinking": thinking}
    user1 = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=False, tokenize=True, **kwargs
    )
    prompt1 = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True, **kwargs
    )
    assert first.cached_tokens == 0 and first.prompt_tokens == len(prompt1)
    # turn 2 does not extend turn 1's prompt (the think block), but it extends the boundary after "hello"
    assert second.cached_tokens == len(user1) < len(prompt1)
    assert second.prefilled == second.prompt_tokens - len(user1)
    text = out.getvalue()
    if thinking:  # the prompt opened a think block: the output is reasoning, collapsed to one line
        assert text.count("▸ thought for") == 2 and session.last_reasoning
        assert session.messages[1]["content"] == "" and session.messages[1]["reasoning_content"]
    else:
        assert "thought for" not in text and "reasoning_content" not in session.messages[1]


def test_reasoning_is_dimmed_and_collapsible():
    import io

    from rich.console import Console

    from dflash2_mlx.cli.think_splitter import ThinkSplitter
    from dflash2_mlx.cli.turn_printer import TurnPrinter

    for show in (False, True):
        buf = io.StringIO()
        console = Console(file=buf, width=80, force_terminal=True, color_system="standard")
        printer = TurnPrinter(console, show, ThinkSplitter(("<think>", "</think>")))
        for piece in ["<think>", "weighing ", "options</thi", "nk>\n\nThe answer ", "is 4."]:
            printer.feed(piece)
        printer.close()
        screen = ANSI.sub("", buf.getvalue())
        assert printer.reasoning_text == "weighing options" and printer.answer_text == "The answer is 4."
        assert screen.rstrip().endswith("The answer is 4.")
        assert "\x1b[2" in buf.getvalue()  # dim
        if show:
            assert "weighing options" in screen and "thought for" not in screen
        else:
            assert "▸ thought for" in screen and "16 characters" in screen


def test_json_schema_and_the_schema_command_force_answers_into_a_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    child = spawn("--max-tokens", "40", "--json-schema", str(path))
    try:
        turn(child, "hello")
        assert str(path) in command(child, "/schema")
        assert "free text" in command(child, "/schema -")
        turn(child, "again")
        saved = tmp_path / "c.json"
        command(child, f"/save {saved}")
        answers = [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "assistant"]
        jsonschema.validate(json.loads(answers[0]), schema)
        assert "error:" in command(child, f"/schema {tmp_path / 'missing.json'}")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
