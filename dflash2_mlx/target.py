"""TargetRunner: runs an mlx-lm model layer by layer, returning logits and tapped hidden states.

The runner walks the model's own layers and calls their sub-modules; it never patches mlx-lm.
Gated DeltaNet layers (Qwen3.5 / Qwen3.8 hybrids) are walked step by step, computing exactly what
``GatedDeltaNet.__call__`` computes, so that a verify pass can record the recurrence's inputs for
rollback (see ``caches.py``). Their gated attention layers are walked too, so that everything but
the KV cache update and the attention itself runs compiled; other attention layers are called as
they are. Tests pin the walked layers to mlx-lm's own forward, bit for bit.

Supported: mlx-lm models whose text stack is ``<model>.layers`` with ``embed_tokens`` and
``norm`` (Qwen3.5-architecture hybrids, Qwen3, Qwen2, Llama, Mistral and similar).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from .caches import RecurrentInputs, TargetCache


class UnsupportedModel(ValueError):
    """The model's layers cannot be walked by this runner."""


def _text_stack(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the module owning lm_head / args, the inner model with embed_tokens, layers, norm)."""
    outer = getattr(model, "language_model", model)
    inner = getattr(outer, "model", None)
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm")):
        raise UnsupportedModel(
            f"cannot find embed_tokens/layers/norm in {type(model).__module__}; "
            "only decoder-only text models (Qwen3.5/3.8, Qwen3, Llama-style) are supported"
        )
    return outer, inner


# Per-step states cost S x [Hv, Dv, Dk] floats per layer; above this (a 27B model's 16-row
# verify on the CPU) rollback replays instead.
MAX_KEPT_STATE_BYTES = 64 << 20


def _runs_ops_recurrence(gdn: nn.Module) -> bool:
    """True where mlx-lm runs the recurrence as ops step by step (no Metal kernel: its own test)."""
    dk = gdn.head_k_dim
    return not (mx.default_device() == mx.gpu and mx.metal.is_available() and dk >= 32 and dk % 32 == 0)


def _keeps_step_states(gdn: nn.Module, steps: int) -> bool:
    """A verify pass keeps every step's state (for rollback without replay) on the ops path,
    within the memory bound."""
    size = steps * gdn.num_v_heads * gdn.head_v_dim * gdn.head_k_dim * 4
    return _runs_ops_recurrence(gdn) and size <= MAX_KEPT_STATE_BYTES


# Passes of at most this many rows (decode steps, verify blocks) run compiled; prefill chunks,
# whose lengths vary with the prompt, do not (every new shape would be traced and kept).
COMPILED_MAX_ROWS = 16


def gated_delta_with_states(q, k, v, a, b, A_log, dt_bias, state, keep: bool = True):
    """mlx-lm's ops recurrence for a batch of one -> (y [B, S, Hv, Dv], the state after every step
    [B, S, Hv, Dv, Dk]; with ``keep=False`` only the last [B, Hv, Dv, Dk]).

    The same elementwise ops and reductions in the same order as mlx-lm's step function on its
    ops path, so outputs and states are bit for bit the same (a test pins it); rollback then picks
    the state after the last kept step instead of replaying. The inputs are split per step once
    and kept with a singleton step axis, which saves the per-step slicing and reshaping ops that
    dominate a verify pass on the CPU.
    """
    beta = mx.sigmoid(b)
    g = compute_g(A_log, a, dt_bias)
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    decay = g[..., None, None] if g.ndim == 3 else g[..., None, :]
    qs, ks = mx.split(q[..., None, :], S, axis=1), mx.split(k[..., None, :], S, axis=1)  # [B, 1, Hv, 1, Dk]
    vs = mx.split(v[..., None], S, axis=1)  # [B, 1, Hv, Dv, 1]
    decays, betas = mx.split(decay, S, axis=1), mx.split(beta[..., None, None], S, axis=1)
    state = state[:, None]  # [B, 1, Hv, Dv, Dk]
    ys, states = [], []
    for t in range(S):
        state = state * decays[t]
        kv_mem = (state * ks[t]).sum(axis=-1, keepdims=True)
        delta = (vs[t] - kv_mem) * betas[t]
        state = state + ks[t] * delta
        if keep:
            states.append(state)
        else:
            ys.append((state * qs[t]).sum(axis=-1))
    if keep:  # the outputs of all steps at once from the kept states: same products and sums
        states = mx.concatenate(states, axis=1)
        return (states * q[..., None, :]).sum(axis=-1), states
    return mx.concatenate(ys, axis=1), state[:, 0]


def gated_delta_qkv(gdn: nn.Module, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """q, k (normalized as mlx-lm does) and v per head from a GatedDeltaNet's conv output."""
    B, S, _ = conv_out.shape
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    return q, k, v


class TargetRunner:
    """One forward over a token block -> logits for chosen rows + features at tapped layers."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.outer, self.inner = _text_stack(model)
        self.layers = list(self.inner.layers)
        self.kinds = []
        for i, layer in enumerate(self.layers):
            if getattr(layer, "is_linear", False) and hasattr(layer, "linear_attn"):
                if getattr(layer.linear_attn, "sharding_group", None) is not None:
                    raise UnsupportedModel("sharded Gated DeltaNet layers are not supported")
                self.kinds.append("gdn")
            elif hasattr(layer, "self_attn"):
                self.kinds.append("attention")
            else:
                raise UnsupportedModel(f"layer {i} ({type(layer).__name__}) is neither attention nor Gated DeltaNet")
        args = getattr(self.outer, "args", None) or getattr(model, "args", None)
        self.args = args
        self.hidden_size = int(getattr(args, "hidden_size", 0)) or self.embed(mx.array([[0]])).shape[-1]
        self.vocab_size = int(getattr(args, "vocab_size", 0))
        self.max_context = int(getattr(args, "max_position_embeddings", 0) or 0) or None
        self._tied = getattr(args, "tie_word_embeddings", False) or not hasattr(self.outer, "lm_head")
        self._attention_index = self.kinds.index("attention") if "attention" in self.kinds else None
        # Qwen3.5/3.8 gated attention layers are walked (compiled around the KV cache update);
        # other attention layers are called as they are
        self._walked_attention = [
            kind == "attention" and type(layer.self_attn) is Qwen3NextAttention and type(layer.mlp) is Qwen3NextMLP
            for layer, kind in zip(self.layers, self.kinds)
        ]
        # (i, keeps step states) -> compiled gated_delta_layer; ("attention", i) -> the two halves
        self._compiled: dict = {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def make_cache(self) -> TargetCache:
        return TargetCache(self.kinds)

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's raw token embeddings (no embedding scale, as the drafter expects)."""
        return self.inner.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        if self._tied:
            return self.inner.embed_tokens.as_linear(hidden)
        return self.outer.lm_head(hidden)

    def __call__(
        self,
        tokens: mx.array,
        cache: TargetCache,
        taps: Optional[list[int]] = None,
        record: Optional[list[RecurrentInputs]] = None,
        logits_from: int = 0,
    ) -> tuple[mx.array, Optional[mx.array]]:
        """Feed ``tokens`` [1, L] after what ``cache`` holds.

        Returns logits [1, L - logits_from, V] (rows that are never read are not computed; None
        when logits_from >= L) and,
        when ``taps`` is given, the concatenated outputs of those layers [1, L, len(taps) * H].
        With ``record`` (a list), Gated DeltaNet layers append what rollback needs.
        """
        h = self.inner.embed_tokens(tokens)
        mask = None
        if self._attention_index is not None:
            mask = create_attention_mask(h, cache[self._attention_index])
        tapped = {}
        wanted = set(taps or ())
        for i, (layer, kind) in enumerate(zip(self.layers, self.kinds)):
            if kind == "gdn":
                h = self._gated_delta_layer(i, layer, h, cache[i], record)
            elif self._walked_attention[i]:
                h = self._gated_attention_layer(i, layer, h, mask, cache[i])
            else:
                h = layer(h, mask=mask, cache=cache[i])
            if i in wanted:
                tapped[i] = h
        cache.advance(tokens.shape[1])
        logits = None
        if logits_from < tokens.shape[1]:
            logits = self.lm_head(self.inner.norm(h[:, logits_from:] if logits_from else h))
        features = mx.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
        return logits, features

    def _gated_attention_layer(self, i: int, layer: nn.Module, h: mx.array, mask, cache) -> mx.array:
        """A Qwen3.5/3.8 gated attention decoder layer: the projections before and the output gate
        and MLP after the KV cache update run compiled (one trace per row count), the cache
        update and the attention itself as mlx-lm does them."""
        offset = mx.array(cache.offset, dtype=mx.int32)
        if h.shape[1] <= COMPILED_MAX_ROWS:
            before, after = self._compiled.get(("attention", i), (None, None))
            if before is None:
                before = mx.compile(partial(gated_attention_inputs, layer), inputs=layer.state)
                after = mx.compile(partial(gated_attention_output, layer), inputs=layer.state)
                self._compiled[("attention", i)] = (before, after)
        else:
            before, after = partial(gated_attention_inputs, layer), partial(gated_attention_output, layer)
        queries, keys, values, gate = before(h, offset)
        keys, values = cache.update_and_fetch(keys, values)
        attn = layer.self_attn
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        return after(h, out, gate)

    def _gated_delta_layer(self, i: int, layer: nn.Module, h: mx.array, cache, record) -> mx.array:
        """One Gated DeltaNet decoder layer; updates its cache and, with ``record``, appends what
        rollback needs. Block-sized inputs run compiled: one trace per row count, so a decode step
        and a verify pass launch a few fused kernels instead of hundreds of small ops."""
        gdn = layer.linear_attn
        steps = h.shape[1]
        conv_state, state = cache[0], cache[1]
        if conv_state is None:
            conv_state = mx.zeros((h.shape[0], gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=h.dtype)
        keep = record is not None and _keeps_step_states(gdn, steps)
        if state is not None and steps <= COMPILED_MAX_ROWS and not gdn.training:
            fn = self._compiled.get((i, keep))
            if fn is None:
                fn = mx.compile(partial(gated_delta_layer, layer, keep=keep), inputs=layer.state)
                self._compiled[(i, keep)] = fn
            h, (conv_input, q, k, v, a, b), new_state, states = fn(h, conv_state, state)
        else:
            h, (conv_input, q, k, v, a, b), new_state, states = gated_delta_layer(layer, h, conv_state, state, keep)
        cache[0] = mx.contiguous(conv_input[:, -(gdn.conv_kernel_size - 1):, :])
        cache[1] = new_state
        cache.advance(steps)
        if record is not None:
            record.append(RecurrentInputs(
                conv_input, q, k, v, a, b, state, gdn.A_log, gdn.dt_bias, states if keep else None))
        return h


def gated_delta_layer(layer: nn.Module, h: mx.array, conv_state: mx.array, state: Optional[mx.array], keep: bool = False):
    """A Qwen3.5/3.8 Gated DeltaNet decoder layer on ``h`` [1, S, H]; a pure function, so that it
    can be compiled -> (output rows, the recurrence's inputs (conv_input, q, k, v, a, b), the state
    after the pass, and with ``keep`` the state after every step [1, S, Hv, Dv, Dk] (else [])).

    Mirrors mlx_lm.models.qwen3_5 (DecoderLayer and GatedDeltaNet.__call__) for an unpadded batch
    of one; a test pins the two to identical outputs and states.
    """
    gdn = layer.linear_attn
    B, S, H = h.shape
    rows = h.reshape(B * S, H)  # 2-D rows: each projection is then one matmul, no reshapes around it
    x = layer.input_layernorm(rows)
    qkv = gdn.in_proj_qkv(x).reshape(B, S, -1)
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b = gdn.in_proj_b(x).reshape(B, S, -1)
    a = gdn.in_proj_a(x).reshape(B, S, -1)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    conv_out = nn.silu(gdn.conv1d(conv_input))
    q, k, v = gated_delta_qkv(gdn, conv_out)
    states = []
    if keep:
        out, states = gated_delta_with_states(q, k, v, a, b, gdn.A_log, gdn.dt_bias, state)
        new_state = states[:, -1]
    elif _runs_ops_recurrence(gdn) and not gdn.training:  # the same loop, without keeping states
        out, new_state = gated_delta_with_states(q, k, v, a, b, gdn.A_log, gdn.dt_bias, state, keep=False)
    else:
        out, new_state = gated_delta_update(
            q, k, v, a, b, gdn.A_log, gdn.dt_bias, state, None, use_kernel=not gdn.training
        )
    out = gdn.norm(out, z)
    rows = rows + gdn.out_proj(out.reshape(B * S, -1))
    rows = rows + layer.mlp(layer.post_attention_layernorm(rows))
    return rows.reshape(B, S, H), (conv_input, q, k, v, a, b), new_state, states


def gated_attention_inputs(layer: nn.Module, h: mx.array, offset: mx.array):
    """The first half of mlx-lm's Qwen3NextAttention.__call__ (inside a DecoderLayer) for rows
    ``h`` [1, L, H] at positions offset.. -> roped queries and keys, values, the output gate."""
    attn = layer.self_attn
    B, L, H = h.shape
    x = layer.input_layernorm(h.reshape(B * L, H))  # 2-D rows: one matmul per projection
    queries, gate = mx.split(attn.q_proj(x).reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, L, -1)
    keys, values = attn.k_proj(x), attn.v_proj(x)
    queries = attn.q_norm(queries).transpose(0, 2, 1, 3)
    keys = attn.k_norm(keys.reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(queries, offset=offset), attn.rope(keys, offset=offset), values, gate


def gated_attention_output(layer: nn.Module, h: mx.array, attention: mx.array, gate: mx.array) -> mx.array:
    """The rest of the decoder layer: output gate and projection, residual, MLP, residual."""
    B, L, H = h.shape
    out = attention.transpose(0, 2, 1, 3).reshape(B * L, -1)
    rows = h.reshape(B * L, H) + layer.self_attn.o_proj(out * mx.sigmoid(gate.reshape(B * L, -1)))
    rows = rows + layer.mlp(layer.post_attention_layernorm(rows))
    return rows.reshape(B, L, H)
