"""RoPE from a cos/sin table (``dflash2_mlx.fastpaths.rope``): exactly what the RoPE module computes."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash2_mlx.fastpaths import rope


@pytest.mark.parametrize("head_dim,dims,base", [(32, 8, 10000.0), (64, 64, 1e7), (128, 128, 1e6)])
def test_table_rope_is_nn_rope_bit_for_bit(head_dim, dims, base):
    """Partial and full rotation, at offsets well past the table's first size (it grows)."""
    module = nn.RoPE(dims, traditional=False, base=base)
    table = rope.RopeTable(module, head_dim, dims)
    x = mx.random.normal((1, 3, 8, head_dim), key=mx.random.key(dims))
    for offset in (0, 1, 7, 1000, 1023, 4093, 20000):
        cos, sin = rope.table_rows(table.covering(offset + 8), mx.array([offset], dtype=mx.int32), 8)
        ours, theirs = rope.apply(x, cos, sin), module(x, offset=offset)
        assert np.array_equal(np.array(ours), np.array(theirs)), f"offset {offset}"
    assert table.table.shape[0] >= 20008


def test_table_rope_compiled_with_positions_first_is_the_same():
    module = nn.RoPE(16, traditional=False, base=10000.0)
    table = rope.RopeTable(module, 16)
    x = mx.random.normal((5, 2, 16), key=mx.random.key(3))  # [positions, heads, D], as the drafter has
    cos, sin = rope.table_rows(table.covering(505), mx.array([500], dtype=mx.int32), 5)
    compiled = mx.compile(lambda x, c, s: rope.apply(x, c, s))
    want = module(x.transpose(1, 0, 2), offset=500).transpose(1, 0, 2)
    got = compiled(x, cos[:, None], sin[:, None])
    assert np.array_equal(np.array(got), np.array(want))
