"""Whether the worker batches a round's verify passes: ``serve --batch-verify auto|on|off``.

A round is one decode cycle of every active request. Batched, their verify passes are one target
call (``batched_verify.verify_batch``); in turn, one call each. Both give every request exactly
its solo output, so the choice is only about speed, and that depends on the machine: on a Mac a
27B verify is weight-bandwidth bound and N blocks in one pass cost little more than one (the cost
model's prediction), while on a CPU at small widths a pass costs its op count and batching's
extra ops (padding, stacking, splitting) can eat the saving.

``auto`` measures it while serving: per number of requests in the round, it keeps a running mean
of the round's time in each mode, runs the faster one, and every ``probe_every``-th round of that
size runs the other, so that a change (longer contexts, another block size) is seen. Until both
modes have ``warmup`` rounds measured at a size, it alternates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("auto", "on", "off")


@dataclass
class _Means:
    rounds: int = 0  # rounds of this size seen (chosen, measured or not)
    mean: dict = field(default_factory=lambda: {True: None, False: None})  # batched? -> mean seconds
    count: dict = field(default_factory=lambda: {True: 0, False: 0})


class BatchSwitch:
    def __init__(self, mode: str = "auto", probe_every: int = 16, warmup: int = 3, weight: float = 0.2):
        if mode not in MODES:
            raise ValueError(f"--batch-verify must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.probe_every, self.warmup, self.weight = mode, probe_every, warmup, weight
        self._sizes: dict[int, _Means] = {}

    def batch(self, requests: int) -> bool:
        """Whether to batch the verify passes of a round of ``requests`` decode cycles."""
        if requests < 2 or self.mode == "off":
            return False
        if self.mode == "on":
            return True
        m = self._sizes.setdefault(requests, _Means())
        m.rounds += 1
        if min(m.count.values()) < self.warmup:
            return m.count[True] <= m.count[False]
        faster = m.mean[True] <= m.mean[False]
        return (not faster) if m.rounds % self.probe_every == 0 else faster

    def record(self, requests: int, batched: bool, seconds: float) -> None:
        """The time of a round of ``requests`` decode cycles run ``batched`` or in turn."""
        if self.mode != "auto" or requests < 2:
            return
        m = self._sizes.setdefault(requests, _Means())
        old = m.mean[batched]
        m.mean[batched] = seconds if old is None else old + self.weight * (seconds - old)
        m.count[batched] += 1

    def summary(self) -> dict:
        """Per round size: the mean round time in each mode (seconds), for logs and metrics."""
        return {n: {"batched": m.mean[True], "in_turn": m.mean[False]} for n, m in sorted(self._sizes.items())}
