"""Which active request takes the next engine step: round-robin, newcomers first.

The worker keeps up to ``max_active`` generations open at once. Each is the engine's generator
(``generate_speculative`` / ``generate_autoregressive``) and one ``next()`` on it is one *step*:
a prefill chunk or one decode cycle. The generator owns everything the request decodes with
(target cache, drafter context, sampling state), so interleaving steps on the one worker thread
changes no numbers: each request's output equals its solo output.

Policy: a request that has just been admitted takes the very next step (it starts within one step
of arriving, whatever else is running); after that the active requests take turns one step each,
so a request finishes in about its own decode time times the number of active requests.

Plugging in batched steps: ``next_group(n)`` hands out up to ``n`` requests due for a step, in
turn order, and ``finished`` / ``requeue`` take them back. The worker steps a group one request at
a time today (``n = 1``); a batched verify steps the whole group in one target call and returns
each member the same way.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Iterable, TypeVar

R = TypeVar("R")


class RoundRobin(Generic[R]):
    """Turn order of the active requests (any objects; the worker's ``Active``)."""

    def __init__(self, max_active: int):
        if max_active < 1:
            raise ValueError(f"max_active must be at least 1, got {max_active}")
        self.max_active = max_active
        self._new: deque[R] = deque()  # admitted, not stepped yet: they go first, in arrival order
        self._turns: deque[R] = deque()  # stepped at least once: the front is due next
        self._out: list[R] = []  # handed out by next_group, not yet returned

    def __len__(self) -> int:
        return len(self._new) + len(self._turns) + len(self._out)

    def has_room(self) -> bool:
        return len(self) < self.max_active

    def add(self, request: R) -> None:
        """Admit a request; it takes the next step."""
        if not self.has_room():
            raise RuntimeError("no room: check has_room() before add()")
        self._new.append(request)

    def next_group(self, n: int = 1) -> list[R]:
        """Up to ``n`` requests due for a step (newcomers first); each must come back through
        ``requeue`` or ``finished``."""
        group = []
        while len(group) < n and (self._new or self._turns):
            group.append((self._new or self._turns).popleft())
        self._out += group
        return group

    def requeue(self, request: R) -> None:
        """A stepped request that goes on: it waits for its next turn behind the others."""
        self._out.remove(request)
        self._turns.append(request)

    def finished(self, request: R) -> None:
        """A stepped request that ended: it leaves the active set."""
        self._out.remove(request)

    def active(self) -> Iterable[R]:
        """Every active request (for cancelling them all at shutdown)."""
        return [*self._out, *self._new, *self._turns]
