"""The prompt, in chunks, into the target cache (and the drafter's context), then the first token.

The prefix cache is consulted first and snapshots are stored at the requested boundaries; a
generator form lets the server's scheduler interleave other requests between chunks.
"""

from __future__ import annotations

import time
from typing import Generator, Optional, Sequence

import mlx.core as mx

from dflash2_mlx.caches.prefix import PrefixCache, PrefixEntry
from dflash2_mlx.decoding.output import OutputCollector
from dflash2_mlx.decoding.picking import pick_token
from dflash2_mlx.decoding.types import Cancelled, GenerationEvent, GenerationSettings
from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.target import TargetRunner


def prefill(
    runner: TargetRunner,
    prompt: Sequence[int],
    settings: GenerationSettings,
    drafter: Optional[Drafter] = None,
    prefix_cache: Optional[PrefixCache] = None,
    save_at: Sequence[int] = (),
):
    """Feed the prompt in chunks -> (last logits [1, V], target cache, drafter context, cached tokens).

    With a drafter, the tapped features of every prompt position a later block can still see go
    into the drafter's context cache as they are computed. With a prefix cache, the longest
    stored prefix of the prompt is restored first, and snapshots are stored at each position of
    ``save_at`` and at the end of the prompt (chunks are split there).
    """
    chunks = prefill_chunks(runner, prompt, settings, drafter, prefix_cache, save_at)
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value


def prefill_chunks(runner, prompt, settings, drafter, prefix_cache, save_at):
    """``prefill`` as a generator: yields after each chunk but the last, returns prefill's result."""
    total = len(prompt)
    cache = runner.make_cache()
    context = drafter.make_cache() if drafter is not None else None
    taps = drafter.config.target_layer_ids if drafter is not None else None
    window = drafter.config.context_window if drafter is not None else None
    pos, logits = 0, None
    hit = prefix_cache.lookup(prompt, need_context=drafter is not None) if prefix_cache is not None else None
    if hit is not None:
        cache.restore(hit.target)
        if context is not None:
            context = hit.context.copy()
        pos, logits = len(hit.tokens), hit.last_logits
    cached = pos
    tokens = mx.array(prompt, dtype=mx.int32)[None]
    points = sorted({p for p in save_at if pos < p < total} | ({total} if pos < total else set()))
    for point in points:
        while pos < point:
            if settings.cancelled:
                raise Cancelled()
            end = min(pos + settings.prefill_step_size, point)
            logits_from = end - pos - 1 if end == total else end - pos  # only the prompt's last row
            logits, features = runner(tokens[:, pos:end], cache, taps, logits_from=logits_from)
            if context is not None:
                # rows before `point - window` can never be seen by a block from `point` on
                first = pos if window is None else max(pos, point - window)
                context.skip(first - context.offset)
                drafter.absorb(features[:, first - pos :], context)
            computed = [a for a in [logits, *(context.keys if context else [])] if a is not None]
            mx.eval([c.state for c in cache.layers], computed)
            pos = end
            if pos < total:
                yield
        if prefix_cache is not None:
            prefix_cache.store(
                PrefixEntry(
                    tuple(prompt[:point]),
                    cache.snapshot(),
                    context.copy() if context is not None else None,
                    logits[:, -1] if point == total else None,
                )
            )
    return logits.reshape(1, -1), cache, context, cached


def prefill_and_pick(
    runner, prompt, settings, out: OutputCollector, drafter, prefix_cache, save_at, grammar=None
) -> Generator[GenerationEvent, None, Optional[tuple]]:
    """Prefill, then the first generated token -> (cache, context, token, processed logits), or
    None when cancelled during prefill. A generator: with ``settings.yield_during_prefill`` it
    yields an empty event between prefill chunks (use it with ``yield from``)."""
    chunks = prefill_chunks(runner, prompt, settings, drafter, prefix_cache, save_at)
    try:
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                logits, cache, context, out.stats.cached_tokens = done.value
                break
            if settings.yield_during_prefill:
                yield GenerationEvent([], "", elapsed=time.perf_counter() - out.t_start)
    except Cancelled:
        return None
    token, processed = pick_token(logits, list(prompt), settings, len(prompt), grammar)
    mx.eval(token)
    out.stats.prefill_seconds = time.perf_counter() - out.t_start
    return cache, context, token, processed
