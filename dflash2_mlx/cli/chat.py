"""`dflash2-mlx chat`: a streaming multi-turn terminal chat.

One ``PrefixCache`` lives for the whole session and every prompt passes its message boundaries as
``save_at``, so a later turn restores the snapshot of the conversation so far and prefills only
what is new (the per-answer line shows "prompt N (k prefilled, c cached)").
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from dflash2_mlx.cli.common import (
    block_size_option,
    chat_sampling,
    check_positive,
    choose_models,
    controller_line,
    draft_option,
    encode_messages,
    fail,
    fmt_seconds,
    generation_defaults,
    load_models,
    message_boundaries,
    model_option,
    parse_block_size,
    preset_option,
    printable,
    prompt_cache_location,
    prompt_cache_option,
    read_json_schema,
    schema_grammar,
)
from dflash2_mlx.cli.line_reader import read_line_function

DEFAULT_MAX_TOKENS = 2048  # when neither --max-tokens nor the model's generation_config.json sets one

HELP_TEXT = """\
Commands
  /help            this help
  /clear           forget the conversation (the system prompt stays)
  /system [TEXT]   show the system prompt, or set it to TEXT (`/system -` removes it)
  /schema [FILE]   show the JSON Schema answers must follow, or set it from FILE (`/schema -` removes it)
  /stats           token counts, speed and acceptance of every turn; prefix-cache use
  /think           show the reasoning of the last answer (it is collapsed to one line)
  /save FILE       save the conversation as JSON
  /load FILE       load a conversation saved with /save (or a JSON list of messages)
  /exit            leave (Ctrl-D too)
Input
  A line ending in a backslash continues on the next line.
  A line with only \"\"\" starts paste mode: everything up to the next \"\"\" line is one message.
  Ctrl-C stops the answer being written (the chat goes on); at the prompt it clears the input.
  Start a message with // to send a text that begins with a slash."""


class ThinkSplitter:
    """Splits streamed text into reasoning and answer at the think tags, across chunk borders.

    ``feed`` returns (is_reasoning, text) pieces; crossing a tag yields an empty piece of the new
    kind, so the caller sees the switch even before any text of it arrives.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>", in_think: bool = False):
        self.start, self.end, self.in_think = start, end, in_think
        self.buffer = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[bool, str]]:
        self.buffer += text
        out: list[tuple[bool, str]] = []
        while True:
            tag = self.end if self.in_think else self.start
            i = self.buffer.find(tag)
            if i < 0:
                break
            if i:
                out.append((self.in_think, self.buffer[:i]))
            self.buffer = self.buffer[i + len(tag):]
            self.in_think = not self.in_think
            out.append((self.in_think, ""))
        hold = 0
        if not final:
            tag = self.end if self.in_think else self.start
            for n in range(min(len(tag) - 1, len(self.buffer)), 0, -1):
                if self.buffer.endswith(tag[:n]):
                    hold = n
                    break
        emit = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(emit):]
        if emit:
            out.append((self.in_think, emit))
        return out


class TurnPrinter:
    """Writes one answer to the terminal as it streams: reasoning dimmed (collapsed to a one-line
    summary after it ends unless ``show_thinking``), the answer as plain text."""

    def __init__(self, console, show_thinking: bool, splitter: ThinkSplitter):
        self.console, self.show, self.split = console, show_thinking, splitter
        self.reasoning: list[str] = []
        self.answer: list[str] = []
        self.live = None
        self.t_think: Optional[float] = None
        self.think_seconds = 0.0
        self.think_open = False
        self.answer_started = False
        self.last_char = "\n"

    def feed(self, text: str, final: bool = False) -> None:
        for thinking, piece in self.split.feed(text, final):
            if thinking:
                self._think(piece)
            else:
                self._answer(piece)

    def _write(self, text: str, style: Optional[str] = None) -> None:
        if text:
            self.console.print(printable(text), style=style, end="", markup=False, highlight=False,
                               emoji=False, soft_wrap=True)
            self.last_char = text[-1]

    def _think(self, piece: str) -> None:
        if not self.think_open:
            self.think_open, self.t_think = True, time.perf_counter()
        self.reasoning.append(piece)
        if self.show:
            self._write(piece, "dim italic")
            return
        if self.live is None and self.console.is_terminal:
            from rich.live import Live

            self.live = Live(self._think_view(), console=self.console, transient=True, refresh_per_second=8)
            self.live.start()
        if self.live is not None:
            self.live.update(self._think_view())

    def _think_view(self):
        from rich.text import Text

        text = "".join(self.reasoning)
        width = max(20, self.console.width - 4)
        tail = Text(printable(text[-2000:]), style="dim italic").wrap(self.console, width)[-4:]
        head = Text(f"thinking… {len(text)} characters (Ctrl-C stops)\n", style="dim")
        return head + Text("\n").join(tail) if len(tail) else head

    def _close_think(self) -> None:
        if not self.think_open:
            return
        self.think_open = False
        self.think_seconds += time.perf_counter() - (self.t_think or time.perf_counter())
        if self.live is not None:
            self.live.stop()
            self.live = None
        n = len("".join(self.reasoning))
        if self.show:
            if self.last_char != "\n":
                self._write("\n")
        elif n:
            self.console.print(f"▸ thought for {fmt_seconds(self.think_seconds)} ({n} characters; /think shows it)",
                               style="dim", highlight=False, markup=False)

    def _answer(self, piece: str) -> None:
        self._close_think()
        if not self.answer_started:
            piece = piece.lstrip("\n")
            if not piece:
                return
            self.answer_started = True
        self.answer.append(piece)
        self._write(piece)

    def close(self) -> None:
        self.feed("", final=True)
        self._close_think()
        if self.last_char != "\n":
            self.console.print()
            self.last_char = "\n"

    @property
    def answer_text(self) -> str:
        return "".join(self.answer).rstrip()

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning).strip()


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    generated: int
    decode_tps: float
    acceptance_length: Optional[float]  # None in plain decoding
    verify_steps: int
    cycle_tokens: int
    ttft: Optional[float]
    finish_reason: str
    controller: str = ""  # what the block-size policy did (common.controller_line)

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def line(self) -> str:
        parts = [f"{self.generated} tokens", f"{self.decode_tps:.1f} tok/s"]
        if self.acceptance_length is not None:
            parts.append(f"acceptance {self.acceptance_length:.2f}")
        parts.append(f"first token {fmt_seconds(self.ttft)}" if self.ttft is not None else "no token")
        parts.append(f"prompt {self.prompt_tokens} ({self.prefilled} prefilled, {self.cached_tokens} cached)")
        if self.controller:
            parts.append(self.controller)
        return " · ".join(parts)


class ChatSession:
    def __init__(self, target, drafter, settings, console, system: Optional[str], thinking: Optional[bool],
                 show_thinking: bool, cache_bytes: int, label: str, disk=None, schema: Optional[dict] = None,
                 schema_path: Optional[str] = None):
        from dflash2_mlx.caches.prefix import PrefixCache

        self.target, self.drafter, self.settings = target, drafter, settings
        self.tokenizer = target.tokenizer
        self.console = console
        self.system = system
        self.schema, self.schema_path = schema, schema_path  # answers are forced into it (constrained decoding)
        self.template_kwargs = {} if thinking is None else {"enable_thinking": thinking}
        self.show_thinking = show_thinking
        self.cache = PrefixCache(max_bytes=cache_bytes, disk=disk)
        self.label = label
        self.messages: list[dict] = []
        self.turns: list[Turn] = []
        self.last_reasoning = ""
        self.warned = False
        tok = self.tokenizer
        has = getattr(tok, "has_thinking", False)
        self.tags = (tok.think_start, tok.think_end) if has and tok.think_start and tok.think_end else ("<think>", "</think>")
        self.read_line, self.clear_input = read_line_function()

    # -- conversation -------------------------------------------------------------------------

    def conversation(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.messages

    def encode(self) -> tuple[list[int], list[int]]:
        conv = self.conversation()
        ids = encode_messages(self.tokenizer, conv, **self.template_kwargs)
        return ids, message_boundaries(self.tokenizer, conv, ids, **self.template_kwargs)

    def _starts_in_thinking(self, ids: list[int]) -> bool:
        tail = self.tokenizer.decode(ids[-24:])
        start, end = self.tags
        return start in tail and tail.rfind(start) > tail.rfind(end)

    def answer(self, user_text: str) -> Optional[Turn]:
        from dflash2_mlx.cli.common import UserError
        from dflash2_mlx.engine import PromptTooLong, generate_autoregressive, generate_speculative

        self.messages.append({"role": "user", "content": user_text})
        try:
            ids, save_at = self.encode()
        except UserError as e:
            self.messages.pop()
            self.console.print(f"error: {e}", style="red", markup=False, highlight=False)
            return None
        cancel = threading.Event()
        grammar = schema_grammar(self.schema, self.tokenizer, ids) if self.schema is not None else None
        settings = _replace(self.settings, cancel=cancel, grammar=grammar)
        if self.drafter is not None:
            events = generate_speculative(self.target.runner, self.drafter, ids, settings, self.tokenizer,
                                          prefix_cache=self.cache, save_at=save_at)
        else:
            events = generate_autoregressive(self.target.runner, ids, settings, self.tokenizer,
                                             prefix_cache=self.cache, save_at=save_at)
        printer = TurnPrinter(self.console, self.show_thinking,
                              ThinkSplitter(*self.tags, in_think=self._starts_in_thinking(ids)))
        stats, ttft = None, None
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
        try:
            for event in events:
                if event.tokens and ttft is None:
                    ttft = event.elapsed
                printer.feed(event.text)
                stats = event.stats or stats
        except (PromptTooLong, ValueError) as e:
            self.messages.pop()
            printer.close()
            self.console.print(f"error: {e}", style="red", markup=False, highlight=False)
            return None
        finally:
            signal.signal(signal.SIGINT, previous)
        printer.close()
        stopped = stats is not None and stats.finish_reason == "cancelled" or cancel.is_set()
        if stopped:
            self.console.print("[stopped]", style="yellow", markup=False, highlight=False)
        reply = {"role": "assistant", "content": printer.answer_text}
        if printer.reasoning_text:
            reply["reasoning_content"] = printer.reasoning_text
        self.last_reasoning = printer.reasoning_text
        if stopped and not printer.answer_text and not printer.reasoning_text:
            self.messages.pop()  # stopped before any text: as if the message was never sent
        else:
            self.messages.append(reply)  # an interrupted answer stays, as far as it got
        turn = Turn(
            prompt_tokens=stats.prompt_tokens if stats else len(ids),
            cached_tokens=getattr(stats, "cached_tokens", 0) if stats else 0,
            generated=stats.generation_tokens if stats else 0,
            decode_tps=stats.decode_tps if stats else 0.0,
            acceptance_length=stats.acceptance_length if (stats and self.drafter is not None) else None,
            verify_steps=stats.verify_steps if stats else 0,
            cycle_tokens=getattr(stats, "cycle_tokens", 0) if stats else 0,
            ttft=ttft,
            finish_reason=(stats.finish_reason if stats else "cancelled") or "",
            controller=controller_line(stats) if stats else "",
        )
        self.turns.append(turn)
        self.console.print(turn.line(), style="dim", markup=False, highlight=False)
        if (self.drafter is not None and not self.warned and turn.verify_steps >= 8
                and turn.acceptance_length is not None and turn.acceptance_length < 1.5):
            self.warned = True
            self.console.print(
                f"warning: acceptance length {turn.acceptance_length:.2f} is far below what a matched drafter reaches; "
                "is this drafter made for this target (and its quantization)?", style="yellow", markup=False, highlight=False)
        return turn

    # -- commands -----------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a slash command; returns False to leave the chat."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        name = name.lower()
        c = self.console
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            c.print(HELP_TEXT, markup=False, highlight=False)
        elif name == "/clear":
            self.messages.clear()
            self.last_reasoning = ""
            c.print("conversation cleared" + (" (system prompt kept)" if self.system else ""), style="dim")
        elif name == "/system":
            if not arg:
                c.print(f"system prompt: {self.system!r}" if self.system else "no system prompt",
                        markup=False, highlight=False)
            elif arg == "-":
                self.system = None
                c.print("system prompt removed", style="dim")
            else:
                self.system = arg
                c.print("system prompt set", style="dim")
        elif name == "/schema":
            self.set_schema(arg)
        elif name == "/stats":
            self.print_stats()
        elif name == "/think":
            if self.last_reasoning:
                c.print(printable(self.last_reasoning), style="dim italic", markup=False, highlight=False)
            else:
                c.print("the last answer has no reasoning", style="dim")
        elif name == "/save":
            if not arg:
                c.print("usage: /save FILE", style="red")
            else:
                self.save(Path(arg).expanduser())
        elif name == "/load":
            if not arg:
                c.print("usage: /load FILE", style="red")
            else:
                self.load(Path(arg).expanduser())
        else:
            c.print(f"unknown command {name}; /help lists the commands", style="red", markup=False, highlight=False)
        return True

    def set_schema(self, arg: str) -> None:
        from dflash2_mlx.cli.common import UserError

        c = self.console
        if not arg:
            c.print(f"answers follow the JSON Schema in {self.schema_path}" if self.schema is not None
                    else "no JSON Schema: answers are free text", markup=False, highlight=False)
        elif arg == "-":
            self.schema = self.schema_path = None
            c.print("JSON Schema removed: answers are free text", style="dim")
        else:
            try:
                self.schema = read_json_schema(arg, "/schema")
            except UserError as e:
                c.print(f"error: {e}", style="red", markup=False, highlight=False)
                return
            self.schema_path = arg
            c.print(f"answers now follow the JSON Schema in {arg}", style="dim", markup=False, highlight=False)

    def save(self, path: Path) -> None:
        data = {"format": "dflash2-mlx-chat", "version": 1, "model": self.label, "system": self.system,
                "messages": self.messages}
        try:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as e:
            self.console.print(f"error: cannot write {path}: {e.strerror or e}", style="red", markup=False, highlight=False)
            return
        self.console.print(f"saved {len(self.messages)} messages to {path}", style="dim", markup=False, highlight=False)

    def load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            system, messages = _parse_conversation(data)
        except FileNotFoundError:
            self.console.print(f"error: {path} does not exist", style="red", markup=False, highlight=False)
            return
        except (OSError, ValueError) as e:
            self.console.print(f"error: cannot load {path}: {e}", style="red", markup=False, highlight=False)
            return
        self.system, self.messages = system, messages
        self.last_reasoning = ""
        self.console.print(f"loaded {len(messages)} messages from {path}" + (" (with a system prompt)" if system else ""),
                           style="dim", markup=False, highlight=False)
        for m in messages[-2:]:
            text = " ".join(m["content"].split())
            self.console.print(f"  {m['role']}: {printable(text[:100])}{'…' if len(text) > 100 else ''}",
                               style="dim", markup=False, highlight=False)

    def print_stats(self) -> None:
        from rich.table import Table

        c = self.console
        if not self.turns:
            c.print("no answers yet", style="dim")
        else:
            table = Table(title="turns", title_justify="left")
            for col in ("#", "prompt", "prefilled", "cached", "gen", "tok/s", "accept", "TTFT", "end"):
                table.add_column(col, justify="left" if col == "end" else "right")
            for i, t in enumerate(self.turns, 1):
                table.add_row(str(i), str(t.prompt_tokens), str(t.prefilled), str(t.cached_tokens), str(t.generated),
                              f"{t.decode_tps:.1f}", "–" if t.acceptance_length is None else f"{t.acceptance_length:.2f}",
                              fmt_seconds(t.ttft) if t.ttft is not None else "–", t.finish_reason)
            c.print(table)
            cycles = sum(t.verify_steps for t in self.turns)
            total = sum(t.generated for t in self.turns)
            n = len(self.turns)
            line = f"session: {n} answer{'s' if n != 1 else ''}, {total} tokens generated"
            if self.drafter is not None and cycles:
                line += f", acceptance length {sum(t.cycle_tokens for t in self.turns) / cycles:.2f} over {cycles} cycles"
            prefilled = sum(t.prefilled for t in self.turns)
            cached = sum(t.cached_tokens for t in self.turns)
            line += f"; prompt tokens {prefilled} prefilled, {cached} restored from the prefix cache"
            c.print(line, markup=False, highlight=False)
        c.print(f"prefix cache: {len(self.cache)} snapshots, {self.cache.nbytes / 2**20:.1f} MiB of "
                f"{self.cache.max_bytes / 2**30:.1f} GiB; {self.cache.hits} hits, {self.cache.misses} misses",
                markup=False, highlight=False)

    # -- the loop -----------------------------------------------------------------------------

    def read_message(self) -> Optional[str]:
        """One user message (continuation lines and paste mode joined); None at end of input."""
        lines: list[str] = []
        paste = False
        while True:
            prompt = "... " if (lines or paste) else ">>> "
            try:
                line = self.read_line(prompt)
            except EOFError:
                if lines or paste:
                    return "\n".join(lines)
                return None
            except KeyboardInterrupt:
                self.console.print("\n(input cleared; /exit or Ctrl-D leaves)", style="dim")
                lines, paste = [], False
                self.clear_input()
                continue
            if paste:
                if line.strip() == '"""':
                    return "\n".join(lines)
                lines.append(line)
            elif line.strip() == '"""' and not lines:
                paste = True
            elif line.endswith("\\"):
                lines.append(line[:-1])
            else:
                lines.append(line)
                return "\n".join(lines)

    def run(self) -> None:
        # No GNU readline: with it, Ctrl-C at the prompt after an interrupted answer left the
        # terminal raw and unread about one time in five (reproduced with pexpect; the process
        # sat idle in input()). Lines come from cli/line_reader.py, which Ctrl-C interrupts
        # whichever thread takes the signal; the terminal's own line editing (backspace, ^U) works.
        while True:
            text = self.read_message()
            if text is None:
                self.console.print()
                return
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//"):
                if not self.command(text):
                    return
                continue
            if text.startswith("//"):
                text = text[1:]
            self.answer(text)


def _parse_conversation(data) -> tuple[Optional[str], list[dict]]:
    if isinstance(data, dict):
        system, messages = data.get("system"), data.get("messages")
    else:
        system, messages = None, data
    if not isinstance(messages, list):
        raise ValueError('expected {"messages": [...]} or a list of messages')
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise ValueError('each message needs a "role" (system, user or assistant) and a "content" string')
        if m["role"] == "system":
            system = m["content"]
            continue
        out.append({k: m[k] for k in ("role", "content", "reasoning_content") if isinstance(m.get(k), str)})
    if system is not None and not isinstance(system, str):
        raise ValueError('"system" must be a string')
    return system or None, out


def _replace(settings, **changes):
    from dataclasses import replace

    return replace(settings, **changes)


def chat_command(
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_option(),
    preset: Optional[str] = preset_option(),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System prompt (change it later with /system)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Maximum tokens per answer (reasoning included). Default: generation_config.json's max_new_tokens, else 2048."),
    temp: Optional[float] = typer.Option(None, "--temp", help="Sampling temperature; 0 is greedy. Default: the model's generation_config.json, else 0."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass (0, 1]. Default: generation_config.json, else 1."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens; 0 disables. Default: generation_config.json, else 0."),
    min_p: Optional[float] = typer.Option(None, "--min-p", help="Drop tokens below min_p times the top probability. Default: generation_config.json, else 0."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    block_size: str = block_size_option(),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain autoregressive decoding (no drafter), for comparison."),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help="Turn the model's reasoning on or off (chat template enable_thinking). Default: the template's."),
    show_thinking: bool = typer.Option(False, "--show-thinking", help="Print reasoning in full (dimmed) instead of collapsing it to one line."),
    cache_gb: float = typer.Option(2.0, "--cache-gb", help="Memory budget of the prefix cache that lets later turns skip re-reading the conversation."),
    prompt_cache_dir: Optional[str] = prompt_cache_option(),
    prompt_cache_gb: float = typer.Option(8.0, "--prompt-cache-gb", help="Disk budget of the prompt cache directory, in GB."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="Force every answer into this JSON Schema (a file; change it with /schema)."),
) -> None:
    """Chat in the terminal with streaming answers, using the model's chat template.

    Each answer streams as it is decoded; reasoning (<think> text) is shown dimmed while it is
    written and then collapsed to one line (/think shows it, --show-thinking keeps it). After
    each answer one line gives the tokens, decode tok/s, acceptance length (tokens per verify
    cycle), time to first token and how much of the prompt was prefilled versus restored from
    the session's prefix cache: later turns only prefill what is new.

    Input: a line ending in a backslash continues on the next line; a line with only \"\"\"
    starts paste mode, ended by another \"\"\" line. Ctrl-C stops the current answer and the
    chat goes on; Ctrl-D or /exit leaves. Commands: /help, /clear, /system [TEXT],
    /schema [FILE], /stats, /think, /save FILE, /load FILE, /exit.
    """
    from rich.console import Console

    from dflash2_mlx.engine import GenerationSettings

    if max_tokens is not None:
        check_positive("--max-tokens", max_tokens)
    schema = read_json_schema(json_schema) if json_schema is not None else None
    if cache_gb < 0:
        fail(f"--cache-gb must be 0 or more, got {cache_gb}")
    if prompt_cache_gb < 0:
        fail(f"--prompt-cache-gb must be 0 or more, got {prompt_cache_gb}")
    cache_dir = prompt_cache_location(prompt_cache_dir)
    if no_draft and draft_model is not None:
        fail("--no-draft and --draft-model contradict each other: pick one")
    choice = choose_models(model, draft_model, preset, need_draft=not no_draft)
    block_size = parse_block_size(block_size)
    target, drafter = load_models(choice, block_size)
    sampling = chat_sampling(target.path, temp, top_p, top_k, min_p)
    if max_tokens is None:
        max_tokens = int(generation_defaults(target.path).get("max_new_tokens", DEFAULT_MAX_TOKENS))
    settings = GenerationSettings(max_tokens=max_tokens, sampling=sampling, seed=seed, block_size=block_size,
                                  stop_token_ids=sorted(target.tokenizer.eos_token_ids))
    console = Console(highlight=False)
    disk = None
    if cache_dir is not None and prompt_cache_gb > 0:
        from dflash2_mlx.caches.disk import open_disk_cache

        disk = open_disk_cache(cache_dir, int(prompt_cache_gb * 2**30), target, drafter)
    session = ChatSession(target, drafter, settings, console, system, thinking, show_thinking,
                          int(cache_gb * 2**30), choice.label, disk, schema, json_schema)
    blocks = f"block {block_size}" if block_size else "auto block size"
    mode = (f"DFlash 2, {blocks}" if drafter is not None and drafter.config.is_dflash2
            else f"DFlash, {blocks}" if drafter is not None else "plain decoding")
    samp = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
    console.print(f"dflash2-mlx chat · {choice.label} · {mode} · {samp}", style="bold", markup=False)
    console.print("/help for commands · Ctrl-C stops an answer · Ctrl-D or /exit leaves", style="dim", markup=False)
    try:
        session.run()
    finally:
        if disk is not None:
            disk.flush(timeout=30)  # the last turns' snapshots: written before the process ends
