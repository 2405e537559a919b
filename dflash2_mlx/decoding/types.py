"""What a caller gives a generation and gets back: settings, events, statistics and errors.

Kept apart from the loops so that the CLI, the server and the policies can name these types
without importing any decoding code.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dflash2_mlx.caches.token_index import TokenIndex
from dflash2_mlx.constraints.grammar import Grammar
from dflash2_mlx.decoding.profiling import CycleProfiler
from dflash2_mlx.decoding.sampling import LogitsProcessor, SamplingSettings
from dflash2_mlx.policies.block_size import BlockPolicy

SOURCES = ("dflash", "copy")  # where a cycle's drafts came from


class PromptTooLong(ValueError):
    """The prompt does not fit the target's context."""


class Cancelled(Exception):
    """Raised inside prefill when the request's cancel event is set."""


@dataclass
class GenerationSettings:
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    seed: Optional[int] = None
    block_size: Optional[int] = None  # None: the break-even controller picks each cycle's (2..B, or plain)
    policy: Optional[BlockPolicy] = None  # overrides block_size (tests force schedules with it)
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    logits_processors: Sequence[LogitsProcessor] = ()
    prefill_step_size: int = 512
    logprobs: int = 0  # 0: off; n: each token's log-probability and the top n alternatives
    cancel: Optional[threading.Event] = None  # set it to stop (checked between chunks and cycles)
    grammar: Optional[Grammar] = None  # constrained output: masks every picked and verified token
    # DFlash 2 under a grammar: the selector's walk skips candidates the grammar refuses (greedy
    # and sampled). Only acceptance changes, the verify masks keep the output exact. None: walk
    # while the drafter's proposals are often refused (GrammarState.walk_pays); True: every
    # block; False: never (benchmarks/draft_masking.py compares them).
    mask_drafts: Optional[bool] = None
    # An empty event between prefill chunks, so that a caller interleaving several generations
    # (the server's scheduler) can run others' cycles while a long prompt is read.
    yield_during_prefill: bool = False
    # bench --profile: time per cycle phase (adds host syncs, and drafts every block after the
    # previous cycle's sync instead of ahead of it, so that the phases do not overlap)
    profiler: Optional[CycleProfiler] = None
    # Copy drafts (decoding/copying.py): a cycle may verify what followed an earlier occurrence of
    # the last tokens, in the request's own tokens and in ``copy_index`` (earlier answers, shared
    # by the caller's requests: a server keeps one per API key), when the policy expects it to pay.
    copy_drafting: bool = True
    copy_index: Optional[TokenIndex] = None

    @property
    def cancelled(self) -> bool:
        """The caller has asked this request to stop."""
        return self.cancel is not None and self.cancel.is_set()


@dataclass
class GenerationStats:
    """What a generation did. Speculative cycles count in ``verify_steps``/``cycle_tokens``; the
    controller's plain steps in ``plain_steps``/``plain_tokens`` (so ``acceptance_length`` stays the
    drafter's tokens per speculative cycle)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled
    generation_tokens: int = 0
    verify_steps: int = 0
    cycle_tokens: int = 0  # tokens emitted by verify cycles (all but the prefill's)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    finish_reason: Optional[str] = None
    plain_steps: int = 0
    plain_tokens: int = 0
    controller: Optional[dict] = None  # the policy's summary (controller.BlockPolicy.summary)
    # per draft source ("dflash": the drafter's blocks, "copy": copies of the context): cycles,
    # drafted and accepted tokens
    by_source: dict = field(default_factory=lambda: {s: dict(cycles=0, drafted=0, accepted=0) for s in SOURCES})

    def count_cycle(self, block_size: int, accepted: int, emitted: int, source: str = "dflash") -> None:
        """One cycle of the speculative loop emitted ``emitted`` tokens (after clipping)."""
        if block_size == 1:
            self.plain_steps += 1
            self.plain_tokens += emitted
            return
        self.verify_steps += 1
        self.cycle_tokens += emitted
        self.drafted_tokens += block_size - 1
        self.accepted_tokens += accepted
        counts = self.by_source[source]
        counts["cycles"] += 1
        counts["drafted"] += block_size - 1
        counts["accepted"] += accepted
        if source != "dflash":
            return  # per-position acceptance is the drafter's
        for i in range(block_size - 1):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < accepted)

    @property
    def acceptance_length(self) -> float:
        return self.cycle_tokens / self.verify_steps if self.verify_steps else 1.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generation_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generation_tokens": self.generation_tokens,
            "verify_steps": self.verify_steps,
            "acceptance_length": self.acceptance_length,
            "draft_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_by_position": self.acceptance_by_position,
            "by_source": {s: dict(c) for s, c in self.by_source.items()},
            "prefill_tps": self.prefill_tps,
            "decode_tps": self.decode_tps,
            "peak_memory_gb": self.peak_memory_gb,
            "finish_reason": self.finish_reason,
            "plain_steps": self.plain_steps,
            "controller": self.controller,
        }


@dataclass
class GenerationEvent:
    tokens: list[int]  # new tokens of this step
    text: str  # their text (held back while it may still become a stop string)
    accepted: Optional[int] = None  # drafted tokens accepted this cycle (None: not a cycle)
    drafted: int = 0
    stats: Optional[GenerationStats] = None  # on the final event only
    finish_reason: Optional[str] = None
    elapsed: float = 0.0  # seconds from the start of generation (prefill included) to this event
    logprobs: Optional[list] = None  # per token: (logprob, [(token_id, logprob), ...]) when asked
    source: Optional[str] = None  # who drafted this cycle's tokens ("dflash", "copy"); None: no draft
