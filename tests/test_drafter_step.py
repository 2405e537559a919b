"""The drafter's decode-time step (``drafter_step.py``): packed weights, table RoPE, lean attention.

Its agreement with the training forward and with z-lab's reference is pinned in test_rollback.py
and test_parity_reference.py; these pin what the packing adds: it follows weight updates, works
for quantized drafters, and its CPU attention pieces are accurate.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten

from dflash2_mlx.fastpaths import cpu_attention


@pytest.fixture(scope="module")
def drafter_config(hybrid_target):
    cfg, _ = hybrid_target
    return tiny.drafter_config(cfg, version=2, sliding_window=6, block_size=8)


def _draft(drafter, features, blocks):
    cache = drafter.make_cache()
    return drafter(blocks, features, cache)


def test_a_drafter_updated_in_place_drafts_with_its_new_weights(drafter_config):
    """The packed views are rebuilt after load_weights: no stale weights."""
    a, b = tiny.build_drafter(drafter_config, seed=1), tiny.build_drafter(drafter_config, seed=2)
    features = mx.random.normal((1, 9, len(drafter_config.target_layer_ids) * drafter_config.hidden_size))
    blocks = mx.random.normal((1, 8, drafter_config.hidden_size))
    before = _draft(a, features, blocks)
    a.load_weights(tree_flatten(b.parameters()))
    after, want = _draft(a, features, blocks), _draft(b, features, blocks)
    assert not np.allclose(np.array(before), np.array(want), atol=1e-3)
    np.testing.assert_array_equal(np.array(after), np.array(want))


def test_a_quantized_drafter_drafts_what_its_training_forward_computes(drafter_config):
    drafter = tiny.build_drafter(drafter_config)
    features = mx.random.normal((1, 9, len(drafter_config.target_layer_ids) * drafter_config.hidden_size))
    blocks = mx.random.normal((1, 8, drafter_config.hidden_size))
    _draft(drafter, features, blocks)  # packs the float weights first
    nn.quantize(drafter, group_size=32, bits=8)
    assert isinstance(drafter.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    got = _draft(drafter, features, blocks)
    want = drafter.train_forward(blocks, features, mx.array([9]))
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


def test_fast_exp_is_accurate_and_masked_scores_weigh_exactly_zero():
    x = mx.concatenate([mx.linspace(-87.0, 0.0, 200001), mx.array([-mx.inf, -1000.0, -127.5])])
    got, want = np.array(cpu_attention.fast_exp(x), dtype=np.float64), np.exp(np.array(x, dtype=np.float64))
    # Softmax weights relative to the peak's 1: within float32 rounding of 1 (numpy's float32
    # exp is off by up to 1e-7 here). Relative error grows to ~4e-6 far out, where the float32
    # product x * log2(e) has lost the digits; those weights are below 1e-26.
    assert np.abs(got[:-3] - want[:-3]).max() < 1.2e-7
    near = np.array(x[:-3]) > -1.0
    assert (np.abs(got[:-3] - want[:-3]) / want[:-3])[near].max() < 2e-7
    assert got[-3:].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("with_context", [True, False])
def test_block_attention_on_the_cpu_is_attention_over_the_concatenated_parts(with_context):
    """Context and block kept apart, biases added by the score matmul, one softmax over both:
    the same as MLX's attention over the concatenation with the concatenated mask."""
    length, hq, hkv, d, c = 8, 4, 2, 16, 37
    key = iter(mx.random.split(mx.random.key(5), 8))
    q, k, v = (mx.random.normal(s, key=next(key)) for s in ((length, hq, d), (length, hkv, d), (length, hkv, d)))
    ctx_k, ctx_v = mx.random.normal((1, hkv, c, d), key=next(key)), mx.random.normal((1, hkv, c, d), key=next(key))
    hide = mx.random.uniform(shape=(length, c), key=next(key)) < 0.3
    ctx_bias = mx.where(hide, -mx.inf, 0.0)
    block_bias = mx.where(mx.triu(mx.ones((length, length)), k=1) > 0, -mx.inf, 0.0)
    context = (ctx_k, ctx_v, ctx_bias) if with_context else None
    got = cpu_attention.block_attention(q, k, v, context, block_bias, d**-0.5)
    keys, values = k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]
    mask = block_bias
    if with_context:
        keys, values = mx.concatenate([ctx_k, keys], axis=2), mx.concatenate([ctx_v, values], axis=2)
        mask = mx.concatenate([ctx_bias, block_bias], axis=-1)
    want = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], keys, values, scale=d**-0.5, mask=mask)
    want = want[0].transpose(1, 0, 2).reshape(length, hq * d)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6)


@pytest.mark.parametrize("with_context", [True, False])
def test_the_gpu_attention_branch_equals_the_cpu_branch(with_context, monkeypatch):
    """block_attention's GPU branch (MLX's fused attention over the concatenated parts), forced on
    the CPU with DFLASH2_MLX_PATHS=gpu, agrees with the CPU branch (polynomial exp)."""
    from dflash2_mlx.backend import device

    length, hq, hkv, d, c = 8, 8, 2, 32, 29
    key = iter(mx.random.split(mx.random.key(9), 8))
    q, k, v = (mx.random.normal(s, key=next(key)) for s in ((length, hq, d), (length, hkv, d), (length, hkv, d)))
    ctx = (
        mx.random.normal((1, hkv, c, d), key=next(key)),
        mx.random.normal((1, hkv, c, d), key=next(key)),
        mx.where(mx.random.uniform(shape=(1, c), key=next(key)) < 0.3, -mx.inf, 0.0),
    )
    block_bias = mx.array(
        np.where(np.arange(length)[None] <= np.arange(length)[:, None], 0.0, -np.inf).astype(np.float32)
    )
    context = ctx if with_context else None
    assert cpu_attention.uses_fast_exp()
    cpu = cpu_attention.block_attention(q, k, v, context, block_bias, d**-0.5)
    monkeypatch.setenv(device.PATHS_ENV, "gpu")
    assert not cpu_attention.uses_fast_exp()
    gpu = cpu_attention.block_attention(q, k, v, context, block_bias, d**-0.5)
    np.testing.assert_allclose(np.array(gpu), np.array(cpu), atol=2e-6)


def test_on_the_gpu_paths_the_drafters_rope_tables_stay_float32(drafter_config, monkeypatch):
    """On a GPU mx.fast.rope computes in float32 and rounds once: the drafter's table rows stay
    float32 there, and a bf16 row rotated with them is float32 RoPE rounded to bf16, bit for bit.
    On the CPU the rows take x's dtype, as mx.fast.rope's CPU fallback computes in it."""
    from dflash2_mlx.backend import device
    from dflash2_mlx.fastpaths import rope
    from dflash2_mlx.models.drafter_step import DraftStep

    module = nn.RoPE(64, traditional=False, base=1e6)
    table = rope.RopeTable(module, 64).covering(300)
    start = mx.array([250], dtype=mx.int32)
    x = mx.random.normal((8, 3, 64), key=mx.random.key(1)).astype(mx.bfloat16)  # [positions, heads, D]
    cos, sin = DraftStep._rope_rows(table, start, 8, mx.bfloat16)
    assert cos.dtype == mx.bfloat16
    assert mx.array_equal(rope.apply(x, cos, sin), module(x.transpose(1, 0, 2), offset=250).transpose(1, 0, 2))
    monkeypatch.setenv(device.PATHS_ENV, "gpu")
    cos, sin = DraftStep._rope_rows(table, start, 8, mx.bfloat16)
    assert cos.dtype == sin.dtype == mx.float32
    got = rope.apply(x, cos, sin)
    want = module(x.astype(mx.float32).transpose(1, 0, 2), offset=250).transpose(1, 0, 2).astype(mx.bfloat16)
    assert got.dtype == mx.bfloat16 and mx.array_equal(got, want)
    # and a bf16 drafter drafts what its training forward computes, within bf16 rounding
    drafter = tiny.build_drafter(drafter_config)
    drafter.set_dtype(mx.bfloat16)
    features = mx.random.normal((1, 9, len(drafter_config.target_layer_ids) * drafter_config.hidden_size)).astype(
        mx.bfloat16
    )
    blocks = mx.random.normal((1, 8, drafter_config.hidden_size)).astype(mx.bfloat16)
    got = _draft(drafter, features, blocks)
    want = drafter.train_forward(blocks, features, mx.array([9]))
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=0.1, rtol=0.05)
