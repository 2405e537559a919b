"""Attention decoder layers as the target runner walks them: two pure halves around the KV cache.

The runner (``models/target.py``) compiles the half before the cache update (norm, projections,
RoPE) and the half after it (output projection, residual, MLP), one trace per row count, and runs
the cache update and the attention itself as mlx-lm does them. Each half computes exactly what
mlx-lm's decoder layer computes, with the same ops on the same inputs, so the walked layer is
mlx-lm's bit for bit (tests pin it); it only saves ops: on MLX's CPU backend every op costs
5-25 us whatever its size.

Which layers are walked (``walked_kind``): Qwen3.5/3.8 gated attention ("gated") and the plain
pre-norm layers of mlx-lm's ``llama`` (also Mistral), ``qwen2`` and ``qwen3`` ("plain": what GGUF
targets load as). Any other layer is called as it is.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP
from mlx_lm.models.rope_utils import Llama3RoPE

from dflash2_mlx.fastpaths import rope

# down(swiglu(gate(x), up(x))): every one of these MLPs computes just that
SWIGLU_MLPS = (Qwen3NextMLP, llama.MLP, qwen2.MLP, qwen3.MLP)
# x + attn(input_norm(x)), then + mlp(post_norm(.)): the decoder layers of these three models
PLAIN_LAYERS = {
    llama.TransformerBlock: llama.Attention,
    qwen2.TransformerBlock: qwen2.Attention,
    qwen3.TransformerBlock: qwen3.Attention,
}
# RoPE modules whose call takes the position offset as an array (a compiled trace's input);
# others (dynamic NTK scaling, SmolLM3's NoPE layers, ...) keep the layer called as it is
ARRAY_OFFSET_ROPES = (nn.RoPE, Llama3RoPE)


def walked_kind(layer: nn.Module) -> Optional[str]:
    """How the runner walks an attention decoder layer: "gated", "plain" or None (called as it is)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(attn) is Qwen3NextAttention and type(mlp) is Qwen3NextMLP:
        return "gated"
    if (
        PLAIN_LAYERS.get(type(layer)) is type(attn)
        and type(mlp) in SWIGLU_MLPS
        and type(attn.rope) in ARRAY_OFFSET_ROPES
        # a sliding-window layer needs its own mask and cache (the runner has one of each)
        and not getattr(layer, "use_sliding", False)
    ):
        return "plain"
    return None


def _submodule(layer: nn.Module, path: str) -> nn.Module:
    for name in path.split("."):
        layer = getattr(layer, name)
    return layer


def project(x: mx.array, layer: nn.Module, path: str, weights_t: Optional[dict]) -> mx.array:
    """``linear(x)`` for the projection at ``path``; with its weight's transposed view given, the
    same matmul nn.Linear runs (same inputs, same strides: bit for bit), minus the transpose op
    nn.Linear adds on every call. Other projections (quantized, ...) are called as they are."""
    weight_t = weights_t.get(path) if weights_t else None
    linear = _submodule(layer, path)
    if weight_t is None:
        return linear(x)
    return mx.addmm(linear["bias"], x, weight_t) if "bias" in linear else x @ weight_t


def mlp(layer: nn.Module, x: mx.array, weights_t: Optional[dict]) -> mx.array:
    """The layer's MLP; a SwiGLU one (down(swiglu(gate, up))) with transposed views."""
    if type(layer.mlp) not in SWIGLU_MLPS or not weights_t:
        return layer.mlp(x)
    gate, up = project(x, layer, "mlp.gate_proj", weights_t), project(x, layer, "mlp.up_proj", weights_t)
    return project(swiglu(gate, up), layer, "mlp.down_proj", weights_t)


def _roped(attn: nn.Module, queries: mx.array, keys: mx.array, offset: mx.array, rope_rows: tuple):
    """RoPE of queries and keys at positions offset..; with ``rope_rows`` (cos, sin of those
    positions, ``TargetRunner._rope_table``) computed from them, bit for bit what the layer's
    nn.RoPE computes, in fewer ops."""
    if rope_rows:
        return rope.apply(queries, *rope_rows), rope.apply(keys, *rope_rows)
    return attn.rope(queries, offset=offset), attn.rope(keys, offset=offset)


def gated_attention_inputs(
    layer: nn.Module, h: mx.array, offset: mx.array, weights_t: Optional[dict] = None, rope_rows: tuple = ()
):
    """The first half of mlx-lm's Qwen3NextAttention.__call__ (inside a DecoderLayer) for rows
    ``h`` [1, L, H] at positions offset.. -> roped queries and keys, values, the output gate."""
    attn = layer.self_attn
    B, L, H = h.shape
    x = layer.input_layernorm(h.reshape(B * L, H))  # 2-D rows: one matmul per projection
    queries = project(x, layer, "self_attn.q_proj", weights_t)
    queries, gate = mx.split(queries.reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, L, -1)
    keys = project(x, layer, "self_attn.k_proj", weights_t)
    values = project(x, layer, "self_attn.v_proj", weights_t)
    queries = attn.q_norm(queries).transpose(0, 2, 1, 3)
    keys = attn.k_norm(keys.reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    return *_roped(attn, queries, keys, offset, rope_rows), values, gate


def gated_attention_output(
    layer: nn.Module, h: mx.array, attention: mx.array, gate: mx.array, weights_t: Optional[dict] = None
) -> mx.array:
    """The rest of the decoder layer: output gate and projection, residual, MLP, residual."""
    B, L, H = h.shape
    out = attention.transpose(0, 2, 1, 3).reshape(B * L, -1)
    out = project(out * mx.sigmoid(gate.reshape(B * L, -1)), layer, "self_attn.o_proj", weights_t)
    return _residual_mlp(layer, h, out, weights_t)


def plain_attention_inputs(
    layer: nn.Module, h: mx.array, offset: mx.array, weights_t: Optional[dict] = None, rope_rows: tuple = ()
):
    """The first half of mlx-lm's llama / qwen2 / qwen3 Attention.__call__ (inside its
    TransformerBlock) for rows ``h`` [B, L, H] at positions offset.. -> roped queries and keys,
    values. Biases (qwen2, llama's ``attention_bias``) and qwen3's per-head norms as mlx-lm applies them."""
    attn = layer.self_attn
    B, L, H = h.shape
    x = layer.input_layernorm(h.reshape(B * L, H))  # 2-D rows: one matmul per projection
    queries = project(x, layer, "self_attn.q_proj", weights_t).reshape(B, L, attn.n_heads, -1)
    keys = project(x, layer, "self_attn.k_proj", weights_t).reshape(B, L, attn.n_kv_heads, -1)
    values = project(x, layer, "self_attn.v_proj", weights_t).reshape(B, L, attn.n_kv_heads, -1)
    if type(attn) is qwen3.Attention:
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries, keys, values = (t.transpose(0, 2, 1, 3) for t in (queries, keys, values))
    return *_roped(attn, queries, keys, offset, rope_rows), values


def plain_attention_output(
    layer: nn.Module, h: mx.array, attention: mx.array, weights_t: Optional[dict] = None
) -> mx.array:
    """The rest of the TransformerBlock: output projection, residual, MLP, residual."""
    B, L, H = h.shape
    out = project(attention.transpose(0, 2, 1, 3).reshape(B * L, -1), layer, "self_attn.o_proj", weights_t)
    return _residual_mlp(layer, h, out, weights_t)


def _residual_mlp(layer: nn.Module, h: mx.array, attention_out: mx.array, weights_t: Optional[dict]) -> mx.array:
    """h + attention_out [B * L, H], then + mlp(post_attention_layernorm(.)), as [B, L, H]."""
    B, L, H = h.shape
    rows = h.reshape(B * L, H) + attention_out
    rows = rows + mlp(layer, layer.post_attention_layernorm(rows), weights_t)
    return rows.reshape(B, L, H)


# walked_kind -> (the half before the KV cache update, the half after it)
HALVES = {
    "gated": (gated_attention_inputs, gated_attention_output),
    "plain": (plain_attention_inputs, plain_attention_output),
}
