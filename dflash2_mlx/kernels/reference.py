"""The specification of the DFlash 2 hot spots: each operation in plain MLX ops.

These ``reference_*`` functions define what the two-tap dynamic convolution and the selector's
pair-scoring walks compute. The fused Metal kernels in ``metal/`` must reproduce them
(``selfcheck.py`` compares the two), and they are what runs wherever Metal is not available
(Linux CPU, CUDA); ``dispatch.py`` chooses between them.

Shapes (N independent blocks, L rows per block, H channels, G = H / group_size groups, K taps,
R selector rows, k candidates per row, r selector rank, V vocabulary):

- ``two_tap_conv(x [N, L, H], dynamic [N, L, K, G], base [K, H]) -> [N, L, H]``
  ``out[t, c] = sum_j (base[j, c] + dynamic[t, j, c // group]) * x[t - j, c]``, with x before a
  block's first row taken as zero (the convolution never crosses a block boundary).
- ``select_greedy(anchor [N], candidates [N, R, k], unary [N, R, k], hidden [N, R, r],
  predecessor_codebook [V, r], successor_codebook [V, r]) -> path [N, R]``
  Row i scores candidate b after predecessor a as
  ``unary[i, b] + sum(predecessor_codebook[a] * hidden[i] * successor_codebook[b])``;
  the walk starts at the anchor and takes the first maximum of each row. Sampled drafting runs
  the same walk on noised unary scores (``decoding/drafting.py``), so it needs no kernel of its own.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

__all__ = [
    "KERNEL_NAMES",
    "REFERENCES",
    "pair_scores",
    "reference_select_greedy",
    "reference_two_tap_conv",
]

# The operations that have a fused kernel, in the order tools list them.
KERNEL_NAMES = ("two_tap_conv", "select_greedy")


def reference_two_tap_conv(x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
    """Grouped dynamic causal convolution local to each block (reference ops)."""
    n, length, hidden = x.shape
    taps, groups = dynamic.shape[-2], dynamic.shape[-1]
    xf = x.astype(mx.float32)
    # each group's coefficient repeated over its channels: [N, L, K * H] -> K x [N, L, H]
    per_channel = mx.broadcast_to(dynamic.astype(mx.float32)[..., None], (n, length, taps, groups, hidden // groups))
    dynamic_taps = mx.split(per_channel.reshape(n, length, taps * hidden), taps, axis=-1)
    base_taps = mx.split(base.astype(mx.float32), taps, axis=0)  # K x [1, H]
    out = None
    for j in range(taps):
        # tap j multiplies x[t - j], zero before the block's first row: a 0/1 shift matrix times
        # x (exact, and one op where slicing and padding are two)
        shift = np.broadcast_to(np.eye(length, k=-j, dtype=np.float32), (n, length, length))
        term = (base_taps[j] + dynamic_taps[j]) * (xf if j == 0 else mx.array(shift) @ xf)
        out = term if out is None else out + term
    return out.astype(x.dtype)


def pair_scores(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook) -> mx.array:
    """Every row's candidate scores for every possible predecessor, in one batch (float32)
    -> [N, R, k (a), k (b)]: row i's candidate b after candidate a of row i-1; row 0's
    predecessor is the anchor, in every slot a. The walks below only pick rows of these, and
    host-side walks (constrained drafting) read them directly."""
    n, rows, k = candidates.shape
    anchors = mx.broadcast_to(anchor.astype(candidates.dtype).reshape(n, 1, 1), (n, 1, k))
    predecessors = mx.concatenate([anchors, candidates[:, :-1]], axis=1)  # [N, R, k]
    left = predecessor_codebook[predecessors].astype(mx.float32) * hidden.astype(mx.float32)[:, :, None, :]
    succ = successor_codebook[candidates].astype(mx.float32)  # [N, R, k, r]
    return unary.astype(mx.float32)[:, :, None, :] + left @ succ.swapaxes(-1, -2)


def reference_select_greedy(
    anchor: mx.array,
    candidates: mx.array,
    unary: mx.array,
    hidden: mx.array,
    predecessor_codebook: mx.array,
    successor_codebook: mx.array,
) -> mx.array:
    """Greedy path through each row's candidates, starting from the anchor token."""
    pairs = pair_scores(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook)
    # Each row's best candidate after each possible predecessor, for all rows at once; the walk
    # then only follows these pointers (one gather per row).
    best = mx.argmax(pairs, axis=-1).astype(mx.int32)  # [N, R, k]
    n, rows, _ = best.shape
    choice = mx.zeros((n, 1, 1), dtype=mx.int32)  # row 0's predecessor slot: the anchor
    chosen = []
    for row in mx.split(best, rows, axis=1):  # [N, 1, k]
        choice = mx.take_along_axis(row, choice, axis=-1)  # [N, 1, 1]
        chosen.append(choice)
    return mx.take_along_axis(candidates, mx.concatenate(chosen, axis=1), axis=-1)[..., 0]


REFERENCES: dict[str, Callable] = {
    "two_tap_conv": reference_two_tap_conv,
    "select_greedy": reference_select_greedy,
}
