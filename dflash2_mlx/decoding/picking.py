"""One token from one row of logits, exactly as plain decoding picks it, and log-probabilities.

The prefill's first token, every plain decoding step and (through the same processors and masks)
every verify row go through these, which is what makes the speculative output equal plain
decoding's.
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx

from dflash2_mlx.decoding.sampling import apply_processors, keyed_draw
from dflash2_mlx.decoding.types import GenerationSettings


def pick_token(
    logits: mx.array,
    history: Union[list[int], mx.array, None],
    settings: GenerationSettings,
    position: int,
    grammar=None,
) -> tuple[mx.array, mx.array]:
    """(the next token [1], the processed logits [1, V]) from one row of logits [1, V] predicting
    sequence position ``position`` (sampled: the request's keyed draw there, ``settings.seed`` as
    ``setup.start_request`` resolved it). ``history`` is what the logits processors see;
    ``grammar`` (anything with ``mask_next``) masks the row."""
    if settings.logits_processors:
        if not isinstance(history, mx.array):
            history = mx.array(history, dtype=mx.int32)
        logits = apply_processors(settings.logits_processors, history, logits)
    if grammar is not None:
        logits = grammar.mask_next(logits)
    if settings.sampling.greedy:
        return mx.argmax(logits, axis=-1), logits
    return keyed_draw(logits, settings.sampling, settings.seed, position), logits


def token_logprobs(logits: mx.array, tokens: mx.array, n: int):
    """Log-probabilities [R] of ``tokens`` [R] under processed logits [R, V], plus the top n
    alternatives (ids [R, n] and values [R, n], or None for n 0)."""
    logp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top = mx.argsort(-logp, axis=-1)[:, :n] if n > 0 else None
    return chosen, top, (mx.take_along_axis(logp, top, axis=-1) if top is not None else None)


def logprob_list(chosen, top, top_values, rows: int) -> list:
    """``token_logprobs``' arrays as the events carry them: per token (logprob, [(id, logprob)])."""
    out = []
    for i in range(rows):
        alts = list(zip(top[i].tolist(), top_values[i].tolist())) if top is not None else []
        out.append((float(chosen[i].item()), alts))
    return out


def emitted_logprobs(top_n: int, logits: mx.array, tokens: list[int]) -> Optional[list]:
    """What an event carries for ``tokens`` picked from the first rows of ``logits`` [>= len(tokens), V]:
    None unless the request asked for log-probabilities (``top_n`` is then 0 or more alternatives;
    ``GenerationSettings.logprobs`` 0 means off)."""
    if not top_n:
        return None
    rows = len(tokens)
    return logprob_list(*token_logprobs(logits[:rows], mx.array(tokens, dtype=mx.int32), top_n), rows)
