"""Where a speculative cycle's time goes (``dflash2-mlx bench --profile``).

The engine calls ``mark(phase, *arrays)`` at the end of each phase when a profiler is set in
``GenerationSettings.profiler``. Marking evaluates the phase's outputs, so each phase's time is
its own graph building, launches and compute; the extra host syncs make a profiled run slower
than a plain one, which is why only the shares are reported, never the profiled tok/s. A
profiled run also drafts each block after the previous cycle's host sync, where a plain run drafts
it ahead, while the verify pass computes: the phases are then each measured alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

PHASES = ("draft", "select", "verify", "accept", "rollback", "other")
DESCRIPTIONS = {
    "draft": "drafter forward (context rows, block, convolutions) + draft logits",
    "select": "candidate selector (top-k, pair scores, path walk)",
    "verify": "target forward over the block (+ logits processors)",
    "accept": "acceptance test and the host sync that reads its result",
    "rollback": "target cache rollback (KV trim, Gated DeltaNet replay)",
    "other": "Python bookkeeping, events, the caller's own work between cycles",
}


@dataclass
class CycleProfiler:
    seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    cycles: int = 0
    _last: float | None = None

    def cycle_start(self) -> None:
        """Called at the top of every cycle: the time since the last mark is "other"."""
        now = time.perf_counter()
        if self._last is not None:
            self.seconds["other"] += now - self._last
        self._last = now
        self.cycles += 1

    def mark(self, phase: str, *arrays) -> None:
        """End ``phase``: evaluate its outputs and charge the time since the previous mark to it."""
        if arrays:
            mx.eval(*arrays)
        now = time.perf_counter()
        self.seconds[phase] += now - (self._last if self._last is not None else now)
        self._last = now

    def stop(self) -> None:
        """End of generation: the time after the last cycle's rollback is not a cycle's."""
        self._last = None

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def shares(self) -> dict[str, float]:
        total = self.total
        return {p: (s / total if total else 0.0) for p, s in self.seconds.items()}

    def as_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "ms_per_cycle": 1000 * self.total / self.cycles if self.cycles else 0.0,
            "shares": self.shares(),
            "ms": {p: 1000 * s / self.cycles if self.cycles else 0.0 for p, s in self.seconds.items()},
        }
