"""The chat session behind `dflash2-mlx chat`: the conversation, its turns and its slash commands.

``ChatSession`` reads a message (continuation lines and paste mode), runs a slash command or
generates the answer with the session's prefix cache, and records each turn's numbers. One
``PrefixCache`` lives for the whole session and every prompt passes its message boundaries as
``save_at``, so a later turn restores the snapshot of the conversation so far and prefills only
what is new (the per-answer line shows "prompt N (k prefilled, c cached)").
"""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash2_mlx.cli.common import (
    controller_line,
    encode_messages,
    fmt_seconds,
    printable,
    read_json_schema,
    schema_grammar,
)
from dflash2_mlx.cli.line_reader import read_line_function
from dflash2_mlx.cli.think_splitter import ThinkSplitter
from dflash2_mlx.cli.turn_printer import TurnPrinter
from dflash2_mlx.text.chat_template import message_boundaries
from dflash2_mlx.text.reasoning import initial_state, reasoning_tags

__all__ = ["HELP_TEXT", "ChatSession", "Turn"]

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


@dataclass
class Turn:
    """One answer's numbers: the per-answer line and the rows of /stats."""

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
    """One terminal conversation: its messages, system prompt, JSON Schema, turns and prefix cache."""

    def __init__(
        self,
        target,
        drafter,
        settings,
        console,
        system: Optional[str],
        thinking: Optional[bool],
        show_thinking: bool,
        cache_bytes: int,
        label: str,
        disk=None,
        schema: Optional[dict] = None,
        schema_path: Optional[str] = None,
    ):
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
        self.tags = reasoning_tags(self.tokenizer)
        self.read_line, self.clear_input = read_line_function()

    # -- conversation -------------------------------------------------------------------------

    def conversation(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.messages

    def encode(self) -> tuple[list[int], list[int]]:
        conv = self.conversation()
        ids = encode_messages(self.tokenizer, conv, **self.template_kwargs)
        return ids, message_boundaries(self.tokenizer, conv, ids, **self.template_kwargs)

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
            events = generate_speculative(
                self.target.runner,
                self.drafter,
                ids,
                settings,
                self.tokenizer,
                prefix_cache=self.cache,
                save_at=save_at,
            )
        else:
            events = generate_autoregressive(
                self.target.runner, ids, settings, self.tokenizer, prefix_cache=self.cache, save_at=save_at
            )
        printer = TurnPrinter(
            self.console,
            self.show_thinking,
            ThinkSplitter(self.tags, in_think=initial_state(self.tokenizer, ids) == "reasoning"),
        )
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
        if (
            self.drafter is not None
            and not self.warned
            and turn.verify_steps >= 8
            and turn.acceptance_length is not None
            and turn.acceptance_length < 1.5
        ):
            self.warned = True
            self.console.print(
                f"warning: acceptance length {turn.acceptance_length:.2f} is far below what a matched drafter reaches; "
                "is this drafter made for this target (and its quantization)?",
                style="yellow",
                markup=False,
                highlight=False,
            )
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
                c.print(
                    f"system prompt: {self.system!r}" if self.system else "no system prompt",
                    markup=False,
                    highlight=False,
                )
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
            c.print(
                f"answers follow the JSON Schema in {self.schema_path}"
                if self.schema is not None
                else "no JSON Schema: answers are free text",
                markup=False,
                highlight=False,
            )
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
        data = {
            "format": "dflash2-mlx-chat",
            "version": 1,
            "model": self.label,
            "system": self.system,
            "messages": self.messages,
        }
        try:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as e:
            self.console.print(
                f"error: cannot write {path}: {e.strerror or e}", style="red", markup=False, highlight=False
            )
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
        with_system = " (with a system prompt)" if system else ""
        self.console.print(
            f"loaded {len(messages)} messages from {path}{with_system}", style="dim", markup=False, highlight=False
        )
        for m in messages[-2:]:
            text = " ".join(m["content"].split())
            self.console.print(
                f"  {m['role']}: {printable(text[:100])}{'…' if len(text) > 100 else ''}",
                style="dim",
                markup=False,
                highlight=False,
            )

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
                accept = "–" if t.acceptance_length is None else f"{t.acceptance_length:.2f}"
                table.add_row(
                    str(i),
                    str(t.prompt_tokens),
                    str(t.prefilled),
                    str(t.cached_tokens),
                    str(t.generated),
                    f"{t.decode_tps:.1f}",
                    accept,
                    fmt_seconds(t.ttft) if t.ttft is not None else "–",
                    t.finish_reason,
                )
            c.print(table)
            cycles = sum(t.verify_steps for t in self.turns)
            total = sum(t.generated for t in self.turns)
            n = len(self.turns)
            line = f"session: {n} answer{'s' if n != 1 else ''}, {total} tokens generated"
            if self.drafter is not None and cycles:
                acceptance = sum(t.cycle_tokens for t in self.turns) / cycles
                line += f", acceptance length {acceptance:.2f} over {cycles} cycles"
            prefilled = sum(t.prefilled for t in self.turns)
            cached = sum(t.cached_tokens for t in self.turns)
            line += f"; prompt tokens {prefilled} prefilled, {cached} restored from the prefix cache"
            c.print(line, markup=False, highlight=False)
        c.print(
            f"prefix cache: {len(self.cache)} snapshots, {self.cache.nbytes / 2**20:.1f} MiB of "
            f"{self.cache.max_bytes / 2**30:.1f} GiB; {self.cache.hits} hits, {self.cache.misses} misses",
            markup=False,
            highlight=False,
        )

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
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("system", "user", "assistant")
            or not isinstance(m.get("content"), str)
        ):
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
