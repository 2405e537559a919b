"""RoPE from a cos/sin table: a few ops per call instead of the ~15 of ``mx.fast.rope`` on the CPU.

On MLX's CPU backend ``mx.fast.rope`` runs as ops (positions, frequencies, cos, sin, slices,
concatenations) on every call, and every op costs 5-15 us whatever its size. A table of cos/sin
rows for positions 0..P-1, read off the RoPE module itself, turns a call into a split, two
elementwise kernels and a concatenation. For rotate-half RoPE (``traditional=False``) the rows
give exactly the values the module computes, and ``apply`` forms the same products and sums, so
for ``nn.RoPE`` the result is bit for bit ``mx.fast.rope``'s (a test pins it).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx


class RopeTable:
    """cos | sin [P, dims] of a rotate-half RoPE module for positions 0..P-1, grown by doubling.

    Fed ones in the first half of its rotated dims and zeros elsewhere, the module returns
    1 * cos - 0 * sin = cos in the first half and 1 * sin + 0 * cos = sin in the second, with
    whatever frequencies (and scaling) it uses.
    """

    MIN_ROWS = 1024

    def __init__(self, rope: Callable, head_dim: int, dims: Optional[int] = None):
        self.rope, self.head_dim = rope, head_dim
        self.dims = dims or head_dim
        self.table: Optional[mx.array] = None

    def covering(self, end: int) -> mx.array:
        """The table, holding at least positions 0..end-1."""
        size = 0 if self.table is None else self.table.shape[0]
        if end > size:
            size = max(self.MIN_ROWS, size)
            while size < end:
                size *= 2
            half = self.dims // 2
            probe = mx.concatenate([mx.ones((half,)), mx.zeros((self.head_dim - half,))])
            out = self.rope(mx.broadcast_to(probe, (1, 1, size, self.head_dim)), offset=0)
            self.table = out[0, 0, :, : self.dims]
            mx.eval(self.table)
        return self.table


def table_rows(table: mx.array, start: mx.array, length: int) -> tuple[mx.array, mx.array]:
    """cos, sin [length, dims / 2] of positions start..start+length-1 (start: int32 [1])."""
    rows = mx.slice(table, start, (0,), (length, table.shape[1]))
    cos, sin = mx.split(rows, 2, axis=-1)
    return cos, sin


def table_rows_at(table: mx.array, starts: mx.array, length: int) -> tuple[mx.array, mx.array]:
    """cos, sin [N, 1, length, dims / 2] of positions starts[i]..starts[i]+length-1 for each of N
    sequences (starts: int32 [N]): the rows ``table_rows`` gives each, for heads [N, H, length, D]."""
    rows = mx.take(table, starts[:, None] + mx.arange(length, dtype=mx.int32), axis=0)  # [N, length, dims]
    cos, sin = mx.split(rows[:, None], 2, axis=-1)
    return cos, sin


def apply(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [..., D] rotated (rotate-half) in its first ``2 * cos.shape[-1]`` dims; cos and sin
    broadcast against x[..., :dims / 2] (positions on the axis they index). float32 cos/sin on
    a half-precision x compute in float32 and round once to x's dtype, as ``mx.fast.rope`` does
    on a GPU; cos/sin in x's dtype compute in it, as its CPU fallback does."""
    half = cos.shape[-1]
    if 2 * half == x.shape[-1]:
        first, second = mx.split(x, 2, axis=-1)
        rest = []
    else:
        first, second, *rest = mx.split(x, [half, 2 * half], axis=-1)
    out = mx.concatenate([first * cos - second * sin, first * sin + second * cos, *rest], axis=-1)
    return out if out.dtype == x.dtype else out.astype(x.dtype)
