"""Plain decoding: one target step per token. The baseline every speculative output must equal,
greedy or sampled (the same seed draws the same token at each position), with the same
processing and events."""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import mlx.core as mx

from dflash2_mlx.caches.prefix import PrefixCache, PrefixEntry
from dflash2_mlx.decoding.picking import logprob_list, pick_token, token_logprobs
from dflash2_mlx.decoding.prefill import prefill_and_pick
from dflash2_mlx.decoding.setup import start_request
from dflash2_mlx.decoding.types import GenerationEvent, GenerationSettings
from dflash2_mlx.models.target import TargetRunner


def generate_autoregressive(
    runner: TargetRunner,
    prompt: Sequence[int],
    settings: GenerationSettings,
    tokenizer=None,
    prefix_cache: Optional[PrefixCache] = None,
    save_at: Sequence[int] = (),
) -> Iterator[GenerationEvent]:
    """Plain decoding with the same target, processing and events (the baseline)."""
    settings, stats, out = start_request(runner, prompt, settings, tokenizer)
    grammar = settings.grammar.start() if settings.grammar is not None else None
    first = yield from prefill_and_pick(runner, prompt, settings, out, None, prefix_cache, save_at, grammar)
    if first is None:
        yield out.cancel()
        return
    cache, _, token, processed = first
    history = list(prompt)
    while True:
        # Launch the next step on the still-lazy token before reading it (as mlx-lm does): building
        # its graph overlaps this step's compute. Past a stop token the step is wasted, not wrong.
        ahead = None
        if len(history) - len(prompt) + 1 < settings.max_tokens:
            logits, _ = runner(token.reshape(1, 1).astype(mx.int32), cache)
            lazy_history = (
                mx.concatenate([mx.array(history, dtype=mx.int32), token.reshape(1).astype(mx.int32)])
                if settings.logits_processors
                else None
            )
            if grammar is not None:  # the next mask needs this token: read it while the step computes
                mx.async_eval(logits)
                grammar.commit([int(token.item())])
            ahead = pick_token(logits[:, -1], lazy_history, settings, len(history) + 1, grammar)
            mx.async_eval(ahead[0])
        t = int(token.item())
        logprobs = None
        if settings.logprobs:
            logprobs = logprob_list(*token_logprobs(processed, token, settings.logprobs), 1)
        history.append(t)
        event = out.add([t], logprobs=logprobs)
        if out.finished:
            if prefix_cache is not None:  # the cache covers every token, or all but the last
                covered = history if ahead is not None else history[:-1]
                prefix_cache.store(PrefixEntry(tuple(covered), cache.snapshot(), None, None))
            yield out.finish(event)
            return
        yield event
        if settings.cancelled:
            yield out.cancel()
            return
        token, processed = ahead
