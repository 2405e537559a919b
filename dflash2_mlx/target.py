"""TargetRunner: runs an mlx-lm model layer by layer, returning logits and tapped hidden states.

The runner walks the model's own layers and calls their sub-modules; it never patches mlx-lm.
Attention layers are called as they are. Gated DeltaNet layers (Qwen3.5 / Qwen3.8 hybrids) are
walked step by step, computing exactly what ``GatedDeltaNet.__call__`` computes, so that a verify
pass can record the recurrence's inputs for rollback (see ``caches.py``).

Supported: mlx-lm models whose text stack is ``<model>.layers`` with ``embed_tokens`` and
``norm`` (Qwen3.5-architecture hybrids, Qwen3, Qwen2, Llama, Mistral and similar).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, gated_delta_update, normalize_qk

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


def _keeps_step_states(k: mx.array, v: mx.array, steps: int) -> bool:
    """True where mlx-lm runs the recurrence as ops step by step (no Metal kernel: its own test)."""
    dk = k.shape[-1]
    uses_kernel = mx.default_device() == mx.gpu and mx.metal.is_available() and dk >= 32 and dk % 32 == 0
    hv, dv = v.shape[-2:]
    return not uses_kernel and steps * hv * dv * dk * 4 <= MAX_KEPT_STATE_BYTES


def gated_delta_with_states(q, k, v, a, b, A_log, dt_bias, state):
    """mlx-lm's ops recurrence for a batch of one, also returning the state after every step.

    Same ops in the same order as ``gated_delta_update`` on its ops path (mlx-lm's own step
    function), so outputs and final state are bit for bit the same (a test pins it); rollback then
    picks the state after the last kept step instead of replaying.
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
    ys, states = [], []
    for t in range(S):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), states


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
                r = self._gated_delta_net(layer.linear_attn, layer.input_layernorm(h), cache[i], record)
                h = h + r
                h = h + layer.mlp(layer.post_attention_layernorm(h))
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

    @staticmethod
    def _gated_delta_net(gdn: nn.Module, x: mx.array, cache, record) -> mx.array:
        # Mirrors mlx_lm.models.qwen3_5.GatedDeltaNet.__call__ for an unpadded batch of one
        # (a test pins the two to identical outputs and states), recording the recurrence inputs.
        B, S, _ = x.shape
        qkv = gdn.in_proj_qkv(x)
        z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
        b = gdn.in_proj_b(x)
        a = gdn.in_proj_a(x)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        cache[0] = mx.contiguous(conv_input[:, -(gdn.conv_kernel_size - 1):, :])
        conv_out = nn.silu(gdn.conv1d(conv_input))
        q, k, v = gated_delta_qkv(gdn, conv_out)
        state = cache[1]
        states = None
        if record is not None and _keeps_step_states(k, v, S):
            out, states = gated_delta_with_states(q, k, v, a, b, gdn.A_log, gdn.dt_bias, state)
            new_state = states[-1]
        else:
            out, new_state = gated_delta_update(
                q, k, v, a, b, gdn.A_log, gdn.dt_bias, state, None, use_kernel=not gdn.training
            )
        if record is not None:
            record.append(RecurrentInputs(conv_input, q, k, v, a, b, state, gdn.A_log, gdn.dt_bias, states))
        cache[1] = new_state
        cache.advance(S)
        out = gdn.norm(out, z)
        return gdn.out_proj(out.reshape(B, S, -1))
