"""Logits processing shared by speculative and plain decoding, and the request's keyed draws.

The target's distribution p is defined once, here, and both decoders use it: speculative
decoding is lossless only if it accepts against exactly the distribution plain decoding samples
from.

Draws are Gumbel-max with noise keyed by (seed, absolute position): the token at sequence
position n is ``argmax(log p + G_n)``, with ``G_n`` [V] standard Gumbel noise that depends on the
request's seed and n only (``gumbel``). That is exactly a draw from p, and it is the same draw
whoever computes it: plain decoding, a verify row predicting position n, or a plain step of the
speculative loop. So a seed reproduces a request whatever block sizes ran and whatever else ran
in between, and sampled speculative output equals plain sampled output token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence, Union

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


def request_seed(seed: Optional[int]) -> int:
    """The key of a request's draws: its seed (any int, taken mod 2**64), or for an unseeded request
    one drawn from MLX's global random state (so ``mx.random.seed`` still repeats those)."""
    if seed is not None:
        return seed % 2**64
    words = mx.random.randint(0, 1 << 16, (4,)).tolist()  # exact: 16 bits each (randint is float-based)
    return sum(w << (16 * i) for i, w in enumerate(words))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _mix32(x: mx.array) -> mx.array:
    """A 32-bit integer bijection with strong avalanche (lowbias32), on uint32 arrays."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def gumbel(seed: int, positions: Union[int, mx.array], rows: int, ids: Union[int, mx.array]) -> mx.array:
    """Standard Gumbel noise [rows, C] (float32) for the sequence positions ``positions`` + 0..rows-1
    (an int, or an integer array [1] or [] that may still be computing) at token ``ids`` (an int V:
    ids 0..V-1; an array [C] of ids; or [rows, C], each row's own). The value at (n, id) depends on
    (seed, n, id) only.

    Counter-based: a keyed hash of the id, mixed with a keyed hash of the position, then
    ``-log(-log(u))`` of a uniform u in (0, 1) from 23 of its bits (what MLX's own Gumbel uses)."""
    key = _splitmix64(seed)
    k_id, k_pos = key & 0xFFFFFFFF, key >> 32
    ids = mx.arange(ids, dtype=mx.uint32) if isinstance(ids, int) else ids.astype(mx.uint32)
    first = positions if isinstance(positions, int) else positions.reshape(()).astype(mx.uint32)
    at = first + mx.arange(rows, dtype=mx.uint32)
    row = _mix32(_mix32(at ^ k_pos) + 0x632BE5AB)  # [rows]
    return _gumbel_rows(_mix32((ids.reshape(-1, ids.shape[-1]) * 0x9E3779B9) ^ k_id), row)


@partial(mx.compile, shapeless=True)
def _gumbel_rows(mixed_ids: mx.array, row_keys: mx.array) -> mx.array:
    """[1 or rows, C] keyed ids x [rows] keyed positions -> Gumbel noise [rows, C] (fused)."""
    bits = _mix32(mixed_ids ^ row_keys[:, None])
    u = ((bits >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))
    return -mx.log(-mx.log(u))


def keyed_draw(logits: mx.array, s: SamplingSettings, seed: int, first_position) -> mx.array:
    """The tokens [R] drawn from rows [R, V] of logits predicting sequence positions
    first_position + 0..R-1: each row's ``argmax(log p + G_n)`` (tokens with p = 0 are -inf, never
    drawn)."""
    rows, vocab = logits.shape
    return mx.argmax(mx.log(probabilities(logits, s)) + gumbel(seed, first_position, rows, vocab), axis=-1)


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
