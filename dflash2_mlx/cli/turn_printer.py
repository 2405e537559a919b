"""The terminal rendering of one streamed chat answer.

``TurnPrinter`` writes the answer as it streams: reasoning dimmed (a live four-line tail while it
is written, then collapsed to a one-line summary unless ``show_thinking``), the answer as plain
text, control characters made printable.
"""

from __future__ import annotations

import time
from typing import Optional

from dflash2_mlx.cli.common import fmt_seconds, printable
from dflash2_mlx.cli.think_splitter import ThinkSplitter

__all__ = ["TurnPrinter"]


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
            self.console.print(
                printable(text), style=style, end="", markup=False, highlight=False, emoji=False, soft_wrap=True
            )
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
            self.console.print(
                f"▸ thought for {fmt_seconds(self.think_seconds)} ({n} characters; /think shows it)",
                style="dim",
                highlight=False,
                markup=False,
            )

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
