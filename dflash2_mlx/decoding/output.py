"""Generated tokens -> events: stop tokens, stop strings and max tokens clip them, text follows.

Both loops hand every token they decide to an ``OutputCollector``, so the two emit the same
events for the same tokens; ``collect`` runs a generation to its end.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional

import mlx.core as mx

from dflash2_mlx.decoding.types import GenerationEvent, GenerationSettings, GenerationStats
from dflash2_mlx.text.stops import StopStrings


class OutputCollector:
    """Collects tokens, applies stop tokens / strings / max tokens, and builds events."""

    def __init__(self, settings: GenerationSettings, tokenizer, stats: GenerationStats, t_start: float):
        self.settings, self.stats, self.t_start = settings, stats, t_start
        self.stop_ids = set(settings.stop_token_ids)
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()
        self.stops = StopStrings(settings.stop_strings)
        self.tokens: list[int] = []
        self.t_first = self.t_last = None
        self.finished: Optional[str] = None

    @property
    def room(self) -> int:
        """Tokens still allowed by max tokens."""
        return self.settings.max_tokens - len(self.tokens)

    def add(
        self, new: list[int], accepted: Optional[int] = None, drafted: int = 0, logprobs=None, source=None
    ) -> GenerationEvent:
        """Clip ``new`` at a stop token or max tokens; returns the event for what was kept."""
        kept = []
        for t in new:
            if len(self.tokens) + len(kept) >= self.settings.max_tokens:
                self.finished = "length"
                break
            kept.append(t)
            if t in self.stop_ids:
                self.finished = "stop"
                break
        if not self.finished and len(self.tokens) + len(kept) >= self.settings.max_tokens:
            self.finished = "length"
        self.tokens += kept
        now = time.perf_counter()
        self.t_first = self.t_first or now
        self.t_last = now
        text = ""
        if self.detok is not None:
            for t in kept:
                if t not in self.stop_ids:
                    self.detok.add_token(t)
            if self.finished:
                self.detok.finalize()
            text = self.detok.last_segment
            text, hit = self.stops.feed(text, final=self.finished is not None)
            if hit:
                self.finished = "stop"
        if self.finished:
            text += self.stops.flush() if not self.stops.hit else ""
        return GenerationEvent(
            kept,
            text,
            accepted,
            drafted,
            finish_reason=self.finished,
            elapsed=now - self.t_start,
            logprobs=logprobs[: len(kept)] if logprobs is not None else None,
            source=source,
        )

    def cancel(self) -> GenerationEvent:
        """The final event of a cancelled request (whatever text was held back is dropped)."""
        self.finished = "cancelled"
        elapsed = time.perf_counter() - self.t_start
        return self.finish(GenerationEvent([], "", finish_reason="cancelled", elapsed=elapsed))

    def finish(self, event: GenerationEvent) -> GenerationEvent:
        """Make ``event`` the final one: it carries the statistics."""
        s = self.stats
        s.generation_tokens = len(self.tokens)
        s.decode_seconds = (self.t_last - self.t_first) if self.t_first else 0.0
        s.peak_memory_gb = mx.get_peak_memory() / 1e9
        s.finish_reason = self.finished or "length"
        event.stats, event.finish_reason = s, s.finish_reason
        return event


def collect(events: Iterator[GenerationEvent]) -> tuple[list[int], Optional[GenerationStats]]:
    """Run a generation to its end: (all its tokens, the final statistics)."""
    tokens, stats = [], None
    for event in events:
        tokens += event.tokens
        stats = event.stats or stats
    return tokens, stats
