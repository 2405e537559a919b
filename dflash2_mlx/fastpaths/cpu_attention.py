"""Attention for the drafter that stays cheap on MLX's CPU backend.

On the CPU, ``mx.exp`` costs about 30-90 ns per element (a scalar routine, against well under
1 ns for a multiply), so the softmax over the drafter's context (8 block rows x 2K context rows x
heads x layers) became the largest cost of a cycle at long context. There the attention weights
use a polynomial exp that runs fused with the rest of the softmax; everywhere else (Apple GPUs,
CUDA) MLX's fused ``scaled_dot_product_attention`` is used unchanged. The drafter only proposes
tokens, which the target verifies, so this cannot change what is generated, only how often a
draft is accepted (weights within 1.2e-7 of exp, relative to the peak weight's 1).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from dflash2_mlx.backend import device

LOG2E = 1.4426950408889634
# 2^f = e^(f ln 2) on f in [-1/2, 1/2]: Taylor terms (ln 2)^i / i!, truncation error < 6e-9.
_EXP2_TERMS = (
    1.0,
    0.6931471805599453,
    0.2402265069591007,
    0.05550410866482158,
    0.009618129107628477,
    0.0013333558146428443,
    0.00015403530393381608,
    1.525273380405984e-05,
)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 x <= 0 (softmax weights after the max is subtracted); x <= -88 (and
    -inf, a masked score) -> exactly 0. All elementwise ops but one bit view, so it runs fused."""
    t = mx.maximum(x * LOG2E, -127.0)
    m = (0.5 - t).astype(mx.int32)  # round(-t): -t >= 0, so truncation after +0.5 is rounding
    f = t + m.astype(mx.float32)  # in [-1/2, 1/2]
    p = _EXP2_TERMS[-1]
    for c in reversed(_EXP2_TERMS[:-1]):
        p = p * f + c
    two_to_minus_m = mx.view(mx.left_shift(127 - m, 23), mx.float32)  # float32 exponent bits; 0 at m = 127
    return p * two_to_minus_m


def uses_fast_exp() -> bool:
    """The CPU path (polynomial exp, no concatenation); elsewhere, or with DFLASH2_MLX_PATHS=gpu,
    MLX's fused attention."""
    return device.cpu_paths()


def block_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    context: Optional[tuple[mx.array, mx.array, mx.array]],
    block_bias: mx.array,
    scale: float,
) -> mx.array:
    """The drafter block's attention over its context cache and its own rows.

    queries [L, Hq, D] and keys, values [L, Hkv, D]: the block's rows (roped); context: None or
    the cache's (keys [1, Hkv, C, D], values [1, Hkv, C, D], bias [L or 1, C]); block_bias
    [L, L]. Biases are additive (0: visible, -inf: hidden); Hq is a multiple of Hkv (query head h
    uses kv head h // (Hq / Hkv)) -> [L, Hq * D].

    On the CPU the context and the block are never concatenated (a copy of the whole context per
    layer per cycle): one softmax spans both, with the polynomial exp over the context.
    """
    length, hq, d = queries.shape
    hkv = keys.shape[1]
    if not uses_fast_exp():
        q, k, v = (a.transpose(1, 0, 2)[None] for a in (queries, keys, values))
        mask = block_bias
        if context is not None:
            ctx_keys, ctx_values, ctx_bias = context
            k, v = mx.concatenate([ctx_keys, k], axis=2), mx.concatenate([ctx_values, v], axis=2)
            mask = mx.concatenate([mx.broadcast_to(ctx_bias, (length, ctx_bias.shape[-1])), block_bias], axis=-1)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask.astype(q.dtype))
        return out[0].transpose(1, 0, 2).reshape(length, hq * d)
    q = queries.reshape(length, hkv, hq // hkv, d).transpose(2, 1, 0, 3)  # [rep, Hkv, L, D]
    # (keys^T [Hkv, D, S], values [Hkv, S, D], bias, exp) per part; mx.exp over the block's few
    # columns costs less than the polynomial's extra ops
    parts = [(keys.transpose(1, 2, 0), values.transpose(1, 0, 2), block_bias, mx.exp)]
    if context is not None:
        ctx_keys, ctx_values, ctx_bias = context
        parts.append((ctx_keys.swapaxes(-1, -2), ctx_values, ctx_bias, fast_exp))
    scores = [mx.addmm(bias, q, keys_t, alpha=scale) for keys_t, _, bias, _ in parts]  # [rep, Hkv, L, S]
    peak = scores[0].max(axis=-1, keepdims=True)
    for s in scores[1:]:
        peak = mx.maximum(peak, s.max(axis=-1, keepdims=True))
    out = total = None
    for s, (_, part_values, _, exp) in zip(scores, parts):
        weights = exp(s - peak)
        part_out, part_total = weights @ part_values, weights.sum(axis=-1, keepdims=True)
        out = part_out if out is None else out + part_out
        total = part_total if total is None else total + part_total
    out = out / total  # [rep, Hkv, L, D]
    return out.transpose(2, 1, 0, 3).reshape(length, hq * d)
