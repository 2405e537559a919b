"""The reasoning split of streamed text: which pieces are thinking and which are the answer.

``ThinkSplitter`` cuts a stream of text chunks at the tokenizer's reasoning tags, holding back a partial tag at
a chunk's end, so the chat can show reasoning and answer differently as they arrive.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["ThinkSplitter"]


class ThinkSplitter:
    """Splits streamed text into reasoning and answer at the reasoning tags, across chunk borders.

    ``tags`` are the tokenizer's own (``reasoning.reasoning_tags``); None (a model without a
    reasoning block) makes everything answer, as the server's ``OutputParser`` does. ``feed``
    returns (is_reasoning, text) pieces; crossing a tag yields an empty piece of the new kind, so
    the caller sees the switch even before any text of it arrives.
    """

    def __init__(self, tags: Optional[tuple[str, str]], in_think: bool = False):
        self.start, self.end = tags if tags is not None else (None, None)
        self.in_think = in_think and tags is not None
        self.buffer = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[bool, str]]:
        if self.start is None:
            return [(False, text)] if text else []
        self.buffer += text
        out: list[tuple[bool, str]] = []
        while True:
            tag = self.end if self.in_think else self.start
            i = self.buffer.find(tag)
            if i < 0:
                break
            if i:
                out.append((self.in_think, self.buffer[:i]))
            self.buffer = self.buffer[i + len(tag) :]
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
        self.buffer = self.buffer[len(emit) :]
        if emit:
            out.append((self.in_think, emit))
        return out
