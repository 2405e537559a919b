"""The DFlash 2 hot spots: the two-tap dynamic convolution and the selector's pair scoring.

Each operation has a reference implementation in plain MLX ops. The reference is the
specification: the fused Metal kernels in ``metal/`` must reproduce it, and it is the fallback
wherever Metal is not available (Linux CPU, CUDA).

Shapes (N independent blocks, L rows per block, H channels, G = H / group_size groups, K taps,
R selector rows, k candidates per row, r selector rank, V vocabulary):

- ``two_tap_conv(x [N, L, H], dynamic [N, L, K, G], base [K, H]) -> [N, L, H]``
  ``out[t, c] = sum_j (base[j, c] + dynamic[t, j, c // group]) * x[t - j, c]``, with x before a
  block's first row taken as zero (the convolution never crosses a block boundary).
- ``select_greedy(anchor [N], candidates [N, R, k], unary [N, R, k], hidden [N, R, r],
  predecessor_codebook [V, r], successor_codebook [V, r]) -> path [N, R]``
  Row i scores candidate b after predecessor a as
  ``unary[i, b] + sum(predecessor_codebook[a] * hidden[i] * successor_codebook[b])``;
  the walk starts at the anchor and takes the first maximum of each row.
- ``select_sampled(..., uniforms [N, R], temperature) -> (path [N, R], q [N, R, k])``
  q_i = softmax(scores_i / temperature) over the k candidates, and the chosen index is the first
  j with ``cumsum(q_i)[j] > u_i`` (inverse CDF with a pre-drawn uniform, so a kernel and the
  reference agree draw for draw).
"""

from __future__ import annotations

import mlx.core as mx


def two_tap_conv(x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
    """Grouped dynamic causal convolution local to each block (reference ops)."""
    n, length, hidden = x.shape
    taps, groups = dynamic.shape[-2], dynamic.shape[-1]
    group_size = hidden // groups
    xf = x.astype(mx.float32).reshape(n, length, groups, group_size)
    dyn = dynamic.astype(mx.float32)
    out = mx.zeros_like(xf)
    for j in range(taps):
        shifted = xf if j == 0 else mx.concatenate(
            [mx.zeros_like(xf[:, :j]), xf[:, : length - j]], axis=1
        )
        kernel = base[j].astype(mx.float32).reshape(1, 1, groups, group_size)
        out = out + (kernel + dyn[:, :, j, :, None]) * shifted
    return out.reshape(n, length, hidden).astype(x.dtype)


def _row_scores(previous, unary_row, hidden_row, cand_row, pred_cb, succ_cb):
    # previous: [N] token ids; hidden_row: [N, r]; cand_row / unary_row: [N, k]
    left = pred_cb[previous].astype(mx.float32) * hidden_row.astype(mx.float32)  # [N, r]
    right = succ_cb[cand_row].astype(mx.float32)  # [N, k, r]
    return unary_row.astype(mx.float32) + (right @ left[:, :, None])[..., 0]


def select_greedy(
    anchor: mx.array,
    candidates: mx.array,
    unary: mx.array,
    hidden: mx.array,
    predecessor_codebook: mx.array,
    successor_codebook: mx.array,
) -> mx.array:
    """Greedy path through each row's candidates, starting from the anchor token."""
    previous = anchor.astype(mx.int32)
    path = []
    for i in range(candidates.shape[1]):
        scores = _row_scores(
            previous, unary[:, i], hidden[:, i], candidates[:, i],
            predecessor_codebook, successor_codebook,
        )
        choice = mx.argmax(scores, axis=-1)
        previous = mx.take_along_axis(candidates[:, i], choice[:, None], axis=-1)[:, 0]
        path.append(previous)
    return mx.stack(path, axis=1)


def select_sampled(
    anchor: mx.array,
    candidates: mx.array,
    unary: mx.array,
    hidden: mx.array,
    predecessor_codebook: mx.array,
    successor_codebook: mx.array,
    uniforms: mx.array,
    temperature: float,
) -> tuple[mx.array, mx.array]:
    """Sampled path plus each row's proposal distribution q over its k candidates."""
    previous = anchor.astype(mx.int32)
    k = candidates.shape[-1]
    path, q_rows = [], []
    for i in range(candidates.shape[1]):
        scores = _row_scores(
            previous, unary[:, i], hidden[:, i], candidates[:, i],
            predecessor_codebook, successor_codebook,
        )
        q = mx.softmax(scores / temperature, axis=-1)
        below = (mx.cumsum(q, axis=-1) <= uniforms[:, i, None]).astype(mx.int32)
        choice = mx.minimum(mx.sum(below, axis=-1), k - 1)
        previous = mx.take_along_axis(candidates[:, i], choice[:, None], axis=-1)[:, 0]
        path.append(previous)
        q_rows.append(q)
    return mx.stack(path, axis=1), mx.stack(q_rows, axis=1)
