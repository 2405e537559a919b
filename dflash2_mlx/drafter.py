"""The DFlash / DFlash 2 block drafter.

One forward pass drafts a whole block: the block is ``[anchor, MASK, ..., MASK]`` at positions
n..n+B-1, its queries attend to the K/V of the projected target features of earlier positions
(the context) and to the block itself (both ways unless the config is causal). The drafter has no
embedding and no LM head of its own: it uses the target's.

DFlash 2 adds a two-tap dynamic convolution around each attention and MLP sublayer and the
candidate selector (``selector.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from . import kernels
from .config import DrafterConfig
from .selector import CandidateSelector


class ContextCache:
    """Per-layer K/V of the drafter's context rows (projected target features).

    Only committed positions enter; the block's own K/V are never stored. A layer with a sliding
    window W keeps its last W-1 rows, which is all any later block row can see.
    """

    def __init__(self, windows: list[Optional[int]]):
        self.windows = windows
        self.keys: list[Optional[mx.array]] = [None] * len(windows)
        self.values: list[Optional[mx.array]] = [None] * len(windows)
        self.offset = 0  # absolute position of the next context row

    def append(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys[layer] is not None:
            keys = mx.concatenate([self.keys[layer], keys], axis=2)
            values = mx.concatenate([self.values[layer], values], axis=2)
        window = self.windows[layer]
        if window is not None and keys.shape[2] > window:
            keys, values = keys[:, :, -window:], values[:, :, -window:]
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def skip(self, rows: int) -> None:
        """Advance past ``rows`` positions that no later block row can see.

        Only valid when every layer is windowed and the skipped rows are at least a window
        long: then nothing cached before them is visible anymore either, and it is dropped so
        that the kept rows stay contiguous positions.
        """
        if rows <= 0:
            return
        self.offset += rows
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)

    @property
    def state(self) -> list:
        return [self.keys, self.values, self.offset]

    def copy(self) -> "ContextCache":
        other = ContextCache(list(self.windows))
        other.keys, other.values, other.offset = list(self.keys), list(self.values), self.offset
        return other

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values if a is not None)


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig, layer: int):
        super().__init__()
        dim, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scale = hd**-0.5
        self.layer = layer
        self.causal = config.layer_is_causal(layer)
        self.window = config.sliding_window if config.layer_is_sliding(layer) else None
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)

    def _keys_values(self, x: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        b, length, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(b, length, self.n_kv_heads, -1))
        values = self.v_proj(x).reshape(b, length, self.n_kv_heads, -1)
        keys = rope(keys.transpose(0, 2, 1, 3), offset=offset)
        return keys, values.transpose(0, 2, 1, 3)

    def __call__(self, x, context, rope, cache: Optional[ContextCache], block_pos, anchors=None) -> mx.array:
        if anchors is not None:
            return self._train(x, context, rope, anchors)
        # x: [1, L, H] block rows at positions block_pos..; context: [1, n, H] new context rows
        # at positions block_pos-n..block_pos-1.
        b, length, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(b, length, self.n_heads, -1))
        queries = rope(queries.transpose(0, 2, 1, 3), offset=block_pos)
        if context is not None and context.shape[1] > 0:
            ctx_k, ctx_v = self._keys_values(context, rope, block_pos - context.shape[1])
            ctx_k, ctx_v = cache.append(self.layer, ctx_k, ctx_v)
        else:
            ctx_k, ctx_v = cache.keys[self.layer], cache.values[self.layer]
        blk_k, blk_v = self._keys_values(x, rope, block_pos)
        if ctx_k is None:
            keys, values, ctx_len = blk_k, blk_v, 0
        else:
            keys = mx.concatenate([ctx_k, blk_k], axis=2)
            values = mx.concatenate([ctx_v, blk_v], axis=2)
            ctx_len = ctx_k.shape[2]
        mask = self._mask(length, ctx_len)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    def absorb(self, context: mx.array, rope, cache: ContextCache) -> None:
        """Append projected context rows [1, n, H] at positions cache.offset.. (no block)."""
        keys, values = self._keys_values(context, rope, cache.offset)
        cache.append(self.layer, keys, values)

    def _train(self, x: mx.array, context: mx.array, rope, anchors: mx.array) -> mx.array:
        # Training: N blocks of one sequence at once. x: [N, L, H], block n at positions
        # anchors[n]..; context: [1, S, H] for positions 0..S-1, of which block n sees p < anchors[n].
        n, length, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(n, length, self.n_heads, -1))
        queries = rope(queries.transpose(0, 2, 1, 3), offset=anchors)
        ctx_k, ctx_v = self._keys_values(context, rope, 0)
        blk_k, blk_v = self._keys_values(x, rope, anchors)
        ctx_len = ctx_k.shape[2]
        keys = mx.concatenate([mx.broadcast_to(ctx_k, (n, *ctx_k.shape[1:])), blk_k], axis=2)
        values = mx.concatenate([mx.broadcast_to(ctx_v, (n, *ctx_v.shape[1:])), blk_v], axis=2)
        query_pos = anchors[:, None, None] + mx.arange(length)[None, :, None]  # [N, L, 1]
        ctx_pos = mx.arange(ctx_len)[None, None, :]
        see_ctx = ctx_pos < anchors[:, None, None]
        if self.window is not None:
            see_ctx = see_ctx & (query_pos - ctx_pos < self.window)
        see_ctx = mx.broadcast_to(see_ctx, (n, length, ctx_len))
        see_blk = self._block_visibility(length)
        see_blk = mx.broadcast_to(see_blk[None], (n, length, length))
        mask = mx.concatenate([see_ctx, see_blk], axis=-1)[:, None]
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(n, length, -1))

    def _block_visibility(self, length: int) -> mx.array:
        """[L, L]: which block rows a block row sees (the reference's rule: the window applies
        inside the block too, both ways when attention is not causal)."""
        query, key = mx.arange(length)[:, None], mx.arange(length)[None]
        visible = mx.ones((length, length), dtype=mx.bool_)
        if self.causal:
            visible = visible & (key <= query)
        if self.window is not None:
            visible = visible & (query - key < self.window) & (key - query < self.window)
        return visible

    def _mask(self, length: int, ctx_len: int) -> Optional[mx.array]:
        # Context rows are the ctx_len positions right before the block, so index distance in
        # [context ; block] is position distance.
        needs_window = self.window is not None and ctx_len + length > self.window
        if not self.causal and not needs_window:
            return None
        query = ctx_len + mx.arange(length)[:, None]
        ctx = mx.arange(ctx_len)[None]
        see_ctx = mx.ones((length, ctx_len), dtype=mx.bool_)
        if self.window is not None:
            see_ctx = query - ctx < self.window
        return mx.concatenate([see_ctx, self._block_visibility(length)], axis=-1)


class DrafterMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TwoTapConv(nn.Module):
    """Grouped dynamic convolution around one sublayer (DFlash 2).

    ``base_kernel`` is [side, tap, channel] (side 0 convolves the sublayer input, side 1 its
    output); ``kernel_projection`` of the sublayer input gives a per-row coefficient for each
    [side, tap, group] that is added to the base kernel of every channel in the group.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = mx.zeros((2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Convolve the sublayer input; return it with the dynamic kernel for ``finish``."""
        dynamic = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.taps, self.groups)
        return kernels.two_tap_conv(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return kernels.two_tap_conv(y, dynamic[..., 1, :, :], self.base_kernel[1])


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer: int):
        super().__init__()
        self.self_attn = DrafterAttention(config, layer)
        self.mlp = DrafterMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.is_dflash2:
            taps, group = config.conv_kernel_size, config.conv_group_size
            self.attention_conv = TwoTapConv(config.hidden_size, taps, group)
            self.mlp_conv = TwoTapConv(config.hidden_size, taps, group)
        self.has_convs = config.is_dflash2

    def __call__(self, x, context, rope, cache, block_pos, anchors=None):
        h = self.input_layernorm(x)
        if self.has_convs:
            h, dynamic = self.attention_conv.prepare(h)
            h = self.attention_conv.finish(self.self_attn(h, context, rope, cache, block_pos, anchors), dynamic)
        else:
            h = self.self_attn(h, context, rope, cache, block_pos, anchors)
        x = x + h
        h = self.post_attention_layernorm(x)
        if self.has_convs:
            h, dynamic = self.mlp_conv.prepare(h)
            h = self.mlp_conv.finish(self.mlp(h), dynamic)
        else:
            h = self.mlp(h)
        return x + h


class Drafter(nn.Module):
    """A DFlash (v1) or DFlash 2 drafter; parameter names match the checkpoint layout."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        if not config.layer_types:
            config.layer_types = ["full_attention"] * config.num_hidden_layers
        taps = len(config.target_layer_ids)
        self.fc = nn.Linear(taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [DrafterLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.is_dflash2:
            self.candidate_selector = CandidateSelector(
                config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
            )
        self._rope = initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def make_cache(self) -> ContextCache:
        return ContextCache(
            [self.config.sliding_window - 1 if self.config.layer_is_sliding(i) else None
             for i in range(self.config.num_hidden_layers)]
        )

    def __call__(self, block_embeds: mx.array, features: Optional[mx.array], cache: ContextCache) -> mx.array:
        """Final-normed hidden rows of the block.

        block_embeds: [1, B, H], the target's embeddings of [anchor, MASK, ...] (times
        ``input_embedding_scale``); features: [1, n, T*H], tapped target hidden states of the
        n positions committed since the last call (they enter the context cache).
        """
        context = None
        if features is not None and features.shape[1] > 0:
            context = self.hidden_norm(self.fc(features))
        block_pos = cache.offset + (0 if context is None else context.shape[1])
        h = block_embeds
        for layer in self.layers:
            h = layer(h, context, self._rope, cache, block_pos)
        cache.offset = block_pos
        return self.norm(h)

    def absorb(self, features: mx.array, cache: ContextCache) -> None:
        """Move the target features of newly committed positions [1, n, T*H] into the context
        cache without drafting (prefill; prefix snapshots)."""
        if features is None or features.shape[1] == 0:
            return
        context = self.hidden_norm(self.fc(features))
        for layer in self.layers:
            layer.self_attn.absorb(context, self._rope, cache)
        cache.offset += features.shape[1]

    def train_forward(self, block_embeds: mx.array, features: mx.array, anchors: mx.array) -> mx.array:
        """Final-normed hidden rows of N blocks drafted from one sequence, in one pass (training).

        block_embeds: [N, B, H] embeddings of [anchor, MASK, ...] per block; features: [1, S, T*H]
        tapped target states of the whole sequence; anchors: [N] anchor positions. Block n sees
        the context strictly before anchors[n] (within the window) and its own rows, never
        another block: exactly what the same block sees at inference.
        """
        context = self.hidden_norm(self.fc(features))
        h = block_embeds
        for layer in self.layers:
            h = layer(h, context, self._rope, None, None, anchors)
        return self.norm(h)

    def logits(self, hidden: mx.array, lm_head: Callable[[mx.array], mx.array]) -> mx.array:
        logits = lm_head(hidden)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and float(cap) > 0:
            logits = mx.tanh(logits / cap) * cap
        return logits
