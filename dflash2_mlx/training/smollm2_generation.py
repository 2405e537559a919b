"""Batched generation of the target's own text for chat prompts of different lengths.

The project's ``TargetRunner`` takes a batch of equal-length rows and has no padding mask. Chat
prompts differ in length, so a batch is left-padded with the document separator
``<|endoftext|>``: the target saw runs of separators before documents in pretraining, so a padded
prompt is still an ordinary text, and the continuation is exactly the target's own output for the
padded token sequence that the drafter then trains on (no mask tricks, nothing approximated).
Prompts are sorted by length before batching so the padding stays short.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from dflash2_mlx.decoding.sampling import SamplingSettings, probabilities

__all__ = ["PAD_TOKEN", "generate_batch", "left_pad", "pad_token_id"]

PAD_TOKEN = "<|endoftext|>"


def pad_token_id(tokenizer) -> int:
    """The id of ``<|endoftext|>``, the padding of a batch."""
    ids = tokenizer.encode(PAD_TOKEN, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer has no single {PAD_TOKEN} token to pad batches with")
    return int(ids[0])


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, min_len: int = 0) -> np.ndarray:
    """int32 [n, L]: the prompts right-aligned, padded on the left to L = max(longest, min_len)."""
    length = max(max(len(p) for p in prompts), min_len)
    out = np.full((len(prompts), length), pad_id, dtype=np.int32)
    for row, p in enumerate(prompts):
        out[row, length - len(p) :] = np.asarray(p, dtype=np.int32)
    return out


def generate_batch(
    runner, tokens: np.ndarray, length: int, sampling: Optional[SamplingSettings] = None, seed: int = 0
) -> np.ndarray:
    """int32 [n, length]: the target's continuation of each row of ``tokens`` [n, L].

    Greedy (argmax, as plain decoding does it) when ``sampling`` is None or greedy; otherwise
    sampled from ``probabilities(logits, sampling)`` with one key per step split from ``seed``,
    so a batch's output is a function of its tokens and seed alone. Generation does not stop at
    an end token: what the target emits after one is still the target's own text.
    """
    cache = runner.make_cache()
    batch = mx.array(tokens, dtype=mx.int32)
    logits, _ = runner(batch, cache, logits_from=batch.shape[1] - 1)
    greedy = sampling is None or sampling.greedy
    keys = None if greedy else mx.random.split(mx.random.key(int(seed)), length)
    generated = []
    for i in range(length):
        last = logits[:, -1]
        if greedy:
            nxt = mx.argmax(last, axis=-1).astype(mx.int32)
        else:
            nxt = mx.random.categorical(mx.log(probabilities(last, sampling)), key=keys[i]).astype(mx.int32)
        generated.append(nxt)
        if i + 1 < length:
            logits, _ = runner(nxt[:, None], cache)
        mx.eval(nxt, logits)
    return np.array(mx.stack(generated, axis=1))
