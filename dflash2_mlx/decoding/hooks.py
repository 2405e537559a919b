"""What the speculative loop calls whether a feature is on or off: the grammar, the profiler, and
the clock that times cycles for the controller.

Each optional feature is an object chosen once per request, a no-op one when off, so the loop
reads the same either way and an unconstrained, unprofiled request pays a method call at most.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, Union

import mlx.core as mx

from dflash2_mlx.constraints.grammar import GrammarState
from dflash2_mlx.decoding.profiling import CycleProfiler


class NoGrammar:
    """Unconstrained output: nothing is masked, and a plain step's next pass may go ahead."""

    state = None
    verify_ahead_of_commit = True

    def mask_next(self, logits: mx.array) -> mx.array:
        return logits

    def mask_verify(self, verify_logits: mx.array, draft_tokens: mx.array) -> mx.array:
        return verify_logits

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        return len(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        pass


class GrammarHooks:
    """A request's grammar matcher as the loop uses it: masks every picked and verified row."""

    # a verify pass's masks need the tokens before it committed: no pass is launched ahead
    verify_ahead_of_commit = False

    def __init__(self, state: GrammarState):
        self.state = state

    def mask_next(self, logits: mx.array) -> mx.array:
        """Mask one row [1, V] by what the grammar allows after the committed tokens."""
        return self.state.mask_next(logits)

    def mask_verify(self, verify_logits: mx.array, draft_tokens: mx.array) -> mx.array:
        """Mask verify row i [R + 1, V] by what the grammar allows after committed + d1..di."""
        mx.async_eval(verify_logits)  # the masks are built on the host while the device computes the pass
        return self.state.mask_verify(verify_logits, draft_tokens.tolist())

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar takes in a row after the committed ones."""
        return self.state.allowed_prefix(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        self.state.commit(tokens)


def grammar_hooks(state: Optional[GrammarState]) -> Union[NoGrammar, GrammarHooks]:
    """The loop's grammar: the matcher's hooks, or ones that do nothing."""
    return GrammarHooks(state) if state is not None else NoGrammar()


class NoProfiler:
    """``CycleProfiler``'s calls, doing nothing (and evaluating nothing) when not profiling."""

    def cycle_start(self) -> None:
        pass

    def mark(self, phase: str, *arrays) -> None:
        pass

    def stop(self) -> None:
        pass


def profiler_or_none(profiler: Optional[CycleProfiler]) -> Union[CycleProfiler, NoProfiler]:
    """The request's profiler, or one that does nothing."""
    return profiler if profiler is not None else NoProfiler()


class CycleClock:
    """Times each cycle for the controller.

    A cycle is timed within one resumption of the generator (from after its ``yield`` to the end
    of its bookkeeping), never across a yield, so time the consumer spends elsewhere never counts.
    When a resumption launches the next cycle's verify pass (after a plain step), that launch is
    the next cycle's cost: it is taken out of this cycle's time and added to the next one's. On
    the CPU backend ``mx.async_eval`` of a big graph waits for most of it, so such a launch holds
    the next pass's compute; launching only a draft ahead stays with this cycle (the pass it waits
    for is this one's, launched when it was built). Charging every launch to the next cycle shifted
    times by one cycle at each switch of size: a plain step after a block was timed at 14 ms and
    the next at 100 (54 each), and the controller decided on those.
    """

    def __init__(self):
        self.resumed = self.launch_started = 0.0
        self.launch_seconds = 0.0  # launching the next cycle's verify pass, during this one
        self.built_ahead = 0.0  # the previous cycle's launch_seconds: launching this one

    def start_cycle(self) -> None:
        self.resumed = time.perf_counter()

    def start_launch(self) -> None:
        self.launch_started = time.perf_counter()

    def end_launch(self, next_pass_launched: bool) -> None:
        """The launch is over; ``next_pass_launched``: it launched the next cycle's verify pass."""
        self.launch_seconds = time.perf_counter() - self.launch_started if next_pass_launched else 0.0

    def cycle_seconds(self) -> float:
        """This cycle's cost so far; call once, at its end."""
        seconds = time.perf_counter() - self.resumed - self.launch_seconds + self.built_ahead
        self.built_ahead = self.launch_seconds
        return seconds
