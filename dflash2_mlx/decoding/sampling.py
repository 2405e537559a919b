"""Logits processing shared by speculative and plain decoding, and exact rejection sampling.

The target's distribution p is defined once, here, and both decoders use it: speculative
decoding is lossless only if it accepts against exactly the distribution plain decoding samples
from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx

# mlx-lm's logits-processor signature: (history tokens [1, n], logits [1, V]) -> logits [1, V]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: mx.array, s: SamplingSettings) -> mx.array:
    """The sampling distribution [..., V] (float32) for temperature > 0 after top-k, min-p, top-p."""
    scores = logits.astype(mx.float32) / s.temperature
    vocab = scores.shape[-1]
    neg_inf = mx.array(-float("inf"), dtype=mx.float32)
    if 0 < s.top_k < vocab:
        kth = mx.sort(scores, axis=-1)[..., vocab - s.top_k, None]
        scores = mx.where(scores < kth, neg_inf, scores)
    if s.min_p > 0:
        top = mx.max(scores, axis=-1, keepdims=True)
        scores = mx.where(scores < top + mx.log(mx.array(s.min_p)), neg_inf, scores)
    probs = mx.softmax(scores, axis=-1)
    if s.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (a token is kept if the mass before it
        # is still below top_p)
        keep = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < s.top_p
        sorted_probs = mx.where(keep, sorted_probs, 0.0)
        probs = mx.put_along_axis(mx.zeros_like(probs), order, sorted_probs, axis=-1)
        probs = probs / mx.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(probs: mx.array) -> mx.array:
    """One token per row from probability rows [..., V]."""
    return mx.random.categorical(mx.log(probs))


def apply_processors(processors: Sequence[LogitsProcessor], history: mx.array, logits: mx.array) -> mx.array:
    """Process verify rows as plain decoding would have: row i sees history + its first i drafts.

    history: [n + R] committed tokens followed by the R drafted tokens; logits: [R + 1, V].
    """
    if not processors:
        return logits
    rows = []
    committed = history.shape[0] - (logits.shape[0] - 1)
    for i in range(logits.shape[0]):
        row = logits[i : i + 1]
        seen = history[None, : committed + i]
        for proc in processors:
            row = proc(seen, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def rejection_step(
    draft_tokens: mx.array,
    p: mx.array,
    q: mx.array,
    candidates: Optional[mx.array] = None,
) -> tuple[mx.array, mx.array]:
    """Speculative sampling for one block, fully on device (one host sync reads the result).

    draft_tokens [R]; p [R + 1, V] target probabilities; q either dense [R, V] (DFlash 1) or
    sparse [R, k] over ``candidates`` [R, k] (DFlash 2). Accept d_i with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from normalize(max(p_i - q_i, 0));
    if all are accepted draw the bonus from p_R.

    Returns (accepted count [], next token per possible stopping row [R + 1]): the caller reads
    ``accepted`` and takes ``next_tokens[accepted]``.
    """
    rows = draft_tokens.shape[0]
    p_draft = mx.take_along_axis(p[:rows], draft_tokens[:, None], axis=-1)[:, 0]
    if candidates is None:
        q_full = q
    else:
        q_full = mx.put_along_axis(mx.zeros_like(p[:rows]), candidates, q.astype(mx.float32), axis=-1)
    q_draft = mx.take_along_axis(q_full, draft_tokens[:, None], axis=-1)[:, 0]
    u = mx.random.uniform(shape=(rows,))
    ok = (u * q_draft < p_draft).astype(mx.int32)  # u < p/q without dividing by q = 0
    accepted = mx.sum(mx.cumprod(ok))
    residual = mx.maximum(p[:rows] - q_full, 0.0)
    total = mx.sum(residual, axis=-1, keepdims=True)
    # p == q exactly leaves no residual mass; rejection then has probability 0, use p.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[:rows])
    next_tokens = sample(mx.concatenate([residual, p[rows:]], axis=0))
    return accepted, next_tokens
