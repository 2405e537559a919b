"""The reasoning split of streamed text: which pieces are thinking and which are the answer.

``ThinkSplitter`` cuts a stream of text chunks at the think tags, holding back a partial tag at
a chunk's end, so the chat can show reasoning and answer differently as they arrive.
"""

from __future__ import annotations

__all__ = ["ThinkSplitter"]


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
