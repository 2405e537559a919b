"""Attention for the drafter that stays cheap on MLX's CPU backend.

On the CPU, ``mx.exp`` costs about 30-90 ns per element (a scalar routine, against well under
1 ns for a multiply), so the softmax over the drafter's context (8 block rows x 2K context rows x
heads x layers) became the largest cost of a cycle at long context. There the attention weights
use a polynomial exp that runs fused with the rest of the softmax; everywhere else (Apple GPUs,
CUDA) MLX's fused ``scaled_dot_product_attention`` is used unchanged. The drafter only proposes
tokens, which the target verifies, so this cannot change what is generated, only how often a
draft is accepted (relative error of the weights < 2e-7, a few float32 ulps).
"""

from __future__ import annotations

import mlx.core as mx

LOG2E = 1.4426950408889634
# 2^f = e^(f ln 2) on f in [-1/2, 1/2]: Taylor terms (ln 2)^i / i!, truncation error < 6e-9.
_EXP2_TERMS = (1.0, 0.6931471805599453, 0.2402265069591007, 0.05550410866482158,
               0.009618129107628477, 0.0013333558146428443, 0.00015403530393381608,
               1.525273380405984e-05)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 x <= 0 (softmax weights after the max is subtracted); -inf -> ~1e-38."""
    t = mx.maximum(x * LOG2E, -126.0)
    n = mx.round(t)
    f = t - n
    p = _EXP2_TERMS[-1]
    for c in reversed(_EXP2_TERMS[:-1]):
        p = p * f + c
    two_to_n = mx.view(mx.left_shift(n.astype(mx.int32) + 127, 23), mx.float32)  # float32 exponent bits
    return p * two_to_n


def uses_fast_exp() -> bool:
    return mx.default_device() == mx.cpu


def attention(queries: mx.array, parts: list[tuple[mx.array, mx.array, mx.array]], scale: float) -> mx.array:
    """Scaled dot-product attention of queries [B, Hq, L, D] over several parts of keys and values,
    each ``(keys [B, Hkv, S_i, D], values [B, Hkv, S_i, D], mask [L, S_i])`` (mask True: visible),
    as if they were concatenated along S; Hq is a multiple of Hkv -> [B, Hq, L, D].

    On the CPU the parts are never concatenated (a copy of the whole context per layer per cycle):
    one softmax spans them, with the polynomial exp.
    """
    if not uses_fast_exp():
        keys, values, mask = (mx.concatenate([p[i] for p in parts], axis=-2 if i < 2 else -1) for i in range(3))
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    b, hq, length, d = queries.shape
    hkv = parts[0][0].shape[1]
    grouped = (queries * scale).reshape(b, hkv, (hq // hkv) * length, d)  # query heads share a kv head
    scores = []
    for keys, _, mask in parts:
        s = (grouped @ keys.swapaxes(-1, -2)).astype(mx.float32).reshape(b, hkv, hq // hkv, length, -1)
        scores.append(mx.where(mask, s, -mx.inf))
    peak = scores[0].max(axis=-1, keepdims=True)
    for s in scores[1:]:
        peak = mx.maximum(peak, s.max(axis=-1, keepdims=True))
    out, total = None, None
    for s, (_, values, mask) in zip(scores, parts):
        weights = mx.where(mask, fast_exp(s - peak), 0.0)
        part_total = weights.sum(axis=-1, keepdims=True)
        part_out = weights.reshape(b, hkv, (hq // hkv) * length, -1).astype(values.dtype) @ values
        out = part_out if out is None else out + part_out
        total = part_total if total is None else total + part_total
    out = out.reshape(b, hkv, hq // hkv, length, d) / total.astype(out.dtype)
    return out.reshape(b, hq, length, d)
