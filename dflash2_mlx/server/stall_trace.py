"""Which scheduler turn held the worker thread for long, and what ran in it.

A request waits while the worker runs another request's step, so one slow turn shows as a latency
spike in every request beside it. ``DFLASH2_MLX_TRACE_STALLS`` turns on one log line (logger
``dflash2_mlx.server.stalls``, level WARNING) per turn slower than a threshold, naming what ran:
each request stepped and the kind of its step, whether a first step had a cost calibration to
do, and the garbage collector's pauses inside the turn.

    DFLASH2_MLX_TRACE_STALLS=1      turns slower than 0.5 s
    DFLASH2_MLX_TRACE_STALLS=0.2    turns slower than 0.2 s (0: every turn, for tests)
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Optional

log = logging.getLogger("dflash2_mlx.server.stalls")

ENV = "DFLASH2_MLX_TRACE_STALLS"
DEFAULT_THRESHOLD = 0.5  # seconds; "1" (on) means this


def threshold_from_env(value: Optional[str] = None) -> Optional[float]:
    """The threshold in seconds ``DFLASH2_MLX_TRACE_STALLS`` asks for; None when tracing is off.

    "1", "on", "true" mean the default threshold; another number is the threshold itself."""
    value = os.environ.get(ENV, "") if value is None else value
    value = value.strip().lower()
    if value in ("", "off", "false", "no"):
        return None
    if value in ("1", "on", "true", "yes"):
        return DEFAULT_THRESHOLD
    try:
        seconds = float(value)
    except ValueError:
        log.warning("%s=%r is not a number of seconds or 1/on; stall tracing is off", ENV, value)
        return None
    return seconds if seconds >= 0 else None


class StallTrace:
    """Times scheduler turns; logs those slower than ``threshold`` seconds with what ran in them."""

    def __init__(self, threshold: Optional[float]):
        self.threshold = threshold
        self.slow_turns = 0
        self.slowest = 0.0  # seconds of the slowest turn seen
        self._gc_started: Optional[float] = None
        self._gc_seconds = 0.0  # garbage collector pauses since the turn began
        self._gc_passes = 0
        self._turn_started: Optional[float] = None
        self._cpu_started = 0.0  # the worker thread's CPU time when the turn began
        self._process_cpu_started = 0.0  # the whole process's (MLX's CPU backend computes on its own threads)
        if threshold is not None:
            gc.callbacks.append(self._on_gc)

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    def close(self) -> None:
        """Stop watching the garbage collector."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # gc runs on whichever thread allocated: only pauses inside a turn of ours are counted,
        # the other threads' are counted too since they hold the GIL the worker needs
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            if self._turn_started is not None:
                self._gc_seconds += time.perf_counter() - self._gc_started
                self._gc_passes += 1
            self._gc_started = None

    def begin(self) -> None:
        """A turn starts."""
        if self.enabled:
            self._gc_seconds, self._gc_passes = 0.0, 0
            self._turn_started = time.perf_counter()
            self._cpu_started = time.thread_time()
            self._process_cpu_started = time.process_time()

    def end(self, what: list[str]) -> Optional[float]:
        """The turn that ``begin`` started has ended, having run ``what`` (one phrase per step);
        logs it when slow. Returns its duration (None when tracing is off)."""
        if not self.enabled or self._turn_started is None:
            return None
        seconds = time.perf_counter() - self._turn_started
        # CPU time of this thread (its Python) and of the process (MLX's CPU backend computes on
        # its own threads): a process far below the wall time was waiting, for the disk or for a
        # CPU core the machine gave to someone else
        cpu = time.thread_time() - self._cpu_started
        process_cpu = time.process_time() - self._process_cpu_started
        self._turn_started = None
        self.slowest = max(self.slowest, seconds)
        if seconds >= self.threshold:
            self.slow_turns += 1
            log.warning(
                "stall: a scheduler turn took %.3f s (CPU: worker thread %.3f s, process %.3f s): %s; "
                "garbage collector %.3f s in %d passes",
                seconds,
                cpu,
                process_cpu,
                "; ".join(what) or "nothing",
                self._gc_seconds,
                self._gc_passes,
            )
        return seconds
