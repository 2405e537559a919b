"""Reading the chat's input lines so that Ctrl-C always interrupts the wait.

``input()`` blocks in a read of the terminal. SIGINT goes to whichever thread of the process the
kernel picks; MLX and the BLAS run threads of their own, and when one of them takes the signal the
main thread's read is not interrupted: Python's handler only runs once a line arrives, so Ctrl-C
at the prompt seemed to do nothing until Enter. Here the wait is a ``select`` with a short
timeout, so the main thread gets back to Python (which raises KeyboardInterrupt) within 0.1 s
whichever thread took the signal. Line editing stays the terminal's own (canonical mode), as
with ``input()`` without GNU readline.
"""

from __future__ import annotations

import os
import select
import sys

POLL_SECONDS = 0.1


class LineReader:
    """``read(prompt)`` -> one line without its newline; EOFError at the end of input. Lines that
    arrive together (a paste) are kept and handed out one by one."""

    def __init__(self, fd: int = 0):
        self.fd = fd
        self.pending = b""  # bytes read past the last line handed out

    def read(self, prompt: str) -> str:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while b"\n" not in self.pending:
            while not select.select([self.fd], [], [], POLL_SECONDS)[0]:
                pass  # back in Python between waits: a pending SIGINT raises KeyboardInterrupt here
            chunk = os.read(self.fd, 65536)
            if not chunk:  # end of input: a last line without a newline, then EOF
                if self.pending:
                    line, self.pending = self.pending, b""
                    return line.decode("utf-8", errors="replace")
                raise EOFError
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode("utf-8", errors="replace").rstrip("\r")

    def clear(self) -> None:
        """Forget lines read ahead (Ctrl-C at the prompt clears the input)."""
        self.pending = b""


def read_line_function():
    """The chat's line reader: a ``LineReader`` on a terminal, ``input`` otherwise (pipes, tests
    feeding stdin), with the clear that Ctrl-C calls."""
    if sys.stdin is not None and sys.stdin.isatty():
        reader = LineReader(sys.stdin.fileno())
        return reader.read, reader.clear
    return input, lambda: None
