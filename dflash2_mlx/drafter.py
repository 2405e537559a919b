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

from dflash2_mlx.kernels import dispatch as kernels
from dflash2_mlx.models.drafter_config import DrafterConfig
from dflash2_mlx.models.drafter_step import DraftStep
from dflash2_mlx.models.selector import CandidateSelector


class ContextCache:
    """Per-layer K/V of the drafter's context rows (projected target features), in fixed buffers.

    Only committed positions enter; the block's own K/V are never stored. Rows live in buffers
    [1, Hkv, C, D] whose capacity C doubles (from ``MIN_CAPACITY``) up to ``limit``, the rows any
    later block can still see (the drafter's context window, W-1; None: unbounded), and then wraps
    around as a ring. A cycle writes only its new rows, and the block step sees the same shapes
    cycle after cycle: that is what lets it be compiled and keeps its cost flat at long context.
    ``positions`` [C] holds each slot's absolute position (-1: empty); the masks come from it.

    A write can be tentative: n rows of which only the first ``valid`` (an array, not yet
    computed) are kept, the rest stored as empty. The decode loop writes a verify pass's rows so
    before it knows how many were accepted, and drafts the next block on top (``next_position``),
    then calls ``commit``. The ring keeps ``headroom`` slots beyond the limit, so that a tentative
    write never overwrites a row a later block can still see.
    """

    MIN_CAPACITY = 256

    def __init__(self, limit: Optional[int], headroom: int = 0):
        self.limit, self.headroom = limit, headroom
        self.keys: list[mx.array] = []  # per layer [1, Hkv, C, D]
        self.values: list[mx.array] = []
        self.positions: Optional[mx.array] = None  # [C] int32
        self.offset = 0  # absolute position of the next context row
        self.start = 0  # the position whose row is in slot 0 (slot of p: (p - start) % C)
        self.tentative: Optional[tuple[int, mx.array]] = None  # (rows written, rows to keep [1])

    @property
    def capacity(self) -> int:
        return 0 if self.positions is None else self.positions.shape[0]

    def write(self, rows: list[tuple[mx.array, mx.array]], valid: Optional[mx.array] = None) -> None:
        """Store per layer the K/V [1, Hkv, n, D] of positions offset..offset+n-1; with ``valid``
        [1] int32, tentatively: rows from ``valid`` on are stored as empty until ``commit``."""
        assert self.tentative is None, "commit the tentative write first"
        n = rows[0][0].shape[2]
        if valid is not None:
            assert n <= self.headroom, f"a tentative write of {n} rows needs that much headroom"
        elif self.limit is not None and n > self.limit:  # only the last `limit` can be seen again
            self.skip(n - self.limit)
            rows = [(k[:, :, n - self.limit :], v[:, :, n - self.limit :]) for k, v in rows]
            n = self.limit
        needed = self.offset + n - self.start
        if needed > self.capacity and (self.limit is None or self.capacity < self._max_capacity):
            self._grow(needed, rows)
        capacity = self.capacity
        first = (self.offset - self.start) % capacity
        pieces = [(first, 0, min(n, capacity - first))]  # (slot, row from, row to): at most one wrap
        if n > capacity - first:
            pieces.append((0, capacity - first, n))
        for slot, lo, hi in pieces:
            at = mx.array([0, 0, slot, 0], dtype=mx.int32)
            for layer, (k, v) in enumerate(rows):
                # slice_update makes a new array: copies (prefix cache snapshots) keep theirs
                self.keys[layer] = mx.slice_update(self.keys[layer], k[:, :, lo:hi], at, (0, 1, 2, 3))
                self.values[layer] = mx.slice_update(self.values[layer], v[:, :, lo:hi], at, (0, 1, 2, 3))
            pos = mx.arange(self.offset + lo, self.offset + hi, dtype=mx.int32)
            if valid is not None:
                pos = mx.where(mx.arange(lo, hi, dtype=mx.int32) < valid, pos, -1)
            self.positions = mx.slice_update(self.positions, pos, mx.array([slot], dtype=mx.int32), (0,))
        if valid is None:
            self.offset += n
        else:
            self.tentative = (n, valid)

    def commit(self, kept: int) -> None:
        """Keep the first ``kept`` rows of the tentative write (what its ``valid`` computed)."""
        assert self.tentative is not None and kept <= self.tentative[0]
        self.offset += kept
        self.tentative = None

    def next_position(self) -> tuple[mx.array, int]:
        """(the position [1] int32 of the next row, an upper bound of it as an int): a block is
        drafted there, also on top of a tentative write."""
        if self.tentative is None:
            return mx.array([self.offset], dtype=mx.int32), self.offset
        n, valid = self.tentative
        return self.offset + valid, self.offset + n

    @property
    def _max_capacity(self) -> int:
        return self.limit + self.headroom

    def _grow(self, needed: int, rows: list[tuple[mx.array, mx.array]]) -> None:
        capacity = max(self.MIN_CAPACITY, self.capacity)
        while capacity < needed:
            capacity *= 2
        if self.limit is not None:
            capacity = min(capacity, self._max_capacity)
        old = self.capacity  # rows are still in slots 0..old-1 in order: a ring wraps only at the limit
        keys, values = [], []
        for layer, (k, _) in enumerate(rows):
            shape = (1, k.shape[1], capacity, k.shape[3])
            grown_k, grown_v = mx.zeros(shape, dtype=k.dtype), mx.zeros(shape, dtype=k.dtype)
            if old:
                grown_k[:, :, :old] = self.keys[layer]
                grown_v[:, :, :old] = self.values[layer]
            keys.append(grown_k)
            values.append(grown_v)
        positions = mx.full((capacity,), -1, dtype=mx.int32)
        if old:
            positions[:old] = self.positions
        self.keys, self.values, self.positions = keys, values, positions

    def skip(self, rows: int) -> None:
        """Advance past ``rows`` positions that no later block row can see.

        Only valid when every layer is windowed and the skipped rows are at least a window
        long: then nothing cached before them is visible anymore either, and it is dropped.
        """
        if rows <= 0:
            return
        self.offset += rows
        self.start = self.offset
        if self.positions is not None:
            self.positions = mx.full(self.positions.shape, -1, dtype=mx.int32)

    def ordered(self, layer: int) -> tuple[mx.array, mx.array, mx.array]:
        """The stored rows of one layer in position order: keys, values [1, Hkv, n, D], positions [n]."""
        if self.positions is None:
            return None, None, mx.zeros((0,), dtype=mx.int32)
        order = mx.argsort(self.positions)
        order = order[self.capacity - int((self.positions >= 0).sum().item()) :]  # empty slots (-1) sort first
        return self.keys[layer][:, :, order], self.values[layer][:, :, order], self.positions[order]

    @property
    def state(self) -> list:
        return [self.keys, self.values, self.positions]

    def copy(self) -> "ContextCache":
        assert self.tentative is None, "commit the tentative write first"
        other = ContextCache(self.limit, self.headroom)
        other.keys, other.values = list(self.keys), list(self.values)
        other.positions, other.offset, other.start = self.positions, self.offset, self.start
        return other

    @property
    def nbytes(self) -> int:
        arrays = self.keys + self.values + ([self.positions] if self.positions is not None else [])
        return sum(a.nbytes for a in arrays)


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

    def keys_values(self, x: mx.array, rope, offset) -> tuple[mx.array, mx.array]:
        """K/V [1, Hkv, L, D] of rows x [1, L, H] at positions offset.. (int or int32 array)."""
        b, length, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(b, length, self.n_kv_heads, -1))
        values = self.v_proj(x).reshape(b, length, self.n_kv_heads, -1)
        keys = rope(keys.transpose(0, 2, 1, 3), offset=offset)
        return keys, values.transpose(0, 2, 1, 3)

    def train(self, x: mx.array, context: mx.array, rope, anchors: mx.array) -> mx.array:
        # Training: N blocks of one sequence at once. x: [N, L, H], block n at positions
        # anchors[n]..; context: [1, S, H] for positions 0..S-1, of which block n sees p < anchors[n].
        n, length, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(n, length, self.n_heads, -1))
        queries = rope(queries.transpose(0, 2, 1, 3), offset=anchors)
        ctx_k, ctx_v = self.keys_values(context, rope, 0)
        blk_k, blk_v = self.keys_values(x, rope, anchors)
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

    def __call__(self, x: mx.array, attend: Callable[[DrafterAttention, mx.array], mx.array]) -> mx.array:
        """``attend(self_attn, h)`` runs the attention sublayer. This module form is the training
        forward's (and the specification of ``drafter_step``, which decodes on packed weights)."""
        h = self.input_layernorm(x)
        if self.has_convs:
            h, dynamic = self.attention_conv.prepare(h)
            h = self.attention_conv.finish(attend(self.self_attn, h), dynamic)
        else:
            h = attend(self.self_attn, h)
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
        # kept out of the module's parameter tree (nn.Module stores dict attributes in it)
        object.__setattr__(self, "_compiled_fns", {})
        object.__setattr__(self, "_draft_step", None)

    def make_cache(self) -> ContextCache:
        # a tentative write is one verify pass's rows: at most a block
        return ContextCache(self.config.context_window, headroom=self.config.block_size)

    def __call__(self, block_embeds: mx.array, features: Optional[mx.array], cache: ContextCache) -> mx.array:
        """Final-normed hidden rows of the block.

        block_embeds: [1, B, H], the target's embeddings of [anchor, MASK, ...] (times
        ``input_embedding_scale``); features: [1, n, T*H], tapped target hidden states of the
        n positions committed since the last call (they enter the context cache first).
        Runs on packed weights (``drafter_step.py``); ``train_forward`` is the same computation.
        """
        self.absorb(features, cache)
        return self._step().block(block_embeds, cache)

    def absorb(self, features: Optional[mx.array], cache: ContextCache, valid: Optional[mx.array] = None) -> None:
        """Move the target features of newly committed positions [1, n, T*H] into the context
        cache (each cycle's accepted rows; prefill chunks; prefix snapshots). With ``valid``
        [1] int32 (not yet computed), tentatively: only the first ``valid`` rows are kept
        (``ContextCache.commit``)."""
        if features is None or features.shape[1] == 0:
            return
        cache.write(self._step().context_rows(features, cache.offset), valid)

    def _step(self) -> DraftStep:
        if self._draft_step is None:
            step = DraftStep(self.config, self.fc, self.hidden_norm, self.layers, self.norm, self._rope)
            object.__setattr__(self, "_draft_step", step)
        return self._draft_step

    def update(self, parameters: dict, strict: bool = True) -> "Drafter":
        """nn.Module.update (load_weights, optimizers and set_dtype go through it); the packed
        weights of the decode step are rebuilt from the new parameters before the next draft."""
        super().update(parameters, strict=strict)
        if self._draft_step is not None:
            self._draft_step.stale = True
        return self

    def update_modules(self, modules: dict, strict: bool = True) -> "Drafter":
        """nn.Module.update_modules (nn.quantize goes through it): the decode step is rebuilt."""
        super().update_modules(modules, strict=strict)
        object.__setattr__(self, "_draft_step", None)
        return self

    def select_greedy(self, hidden: mx.array, logits: mx.array, anchor: mx.array) -> mx.array:
        """The candidate selector's greedy path (DFlash 2), compiled: hidden [N, R, H], logits
        [N, R, V], anchor [N] -> draft tokens [N, R]."""
        # the parameters are captured inputs, so a drafter updated in place (training) is seen
        select = kernels.compiled(self._compiled_fns, "select", self.candidate_selector.greedy, self.state)
        return select(hidden, logits, anchor)

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
            h = layer(h, lambda attn, x: attn.train(x, context, self._rope, anchors))
        return self.norm(h)

    def logits(self, hidden: mx.array, lm_head: Callable[[mx.array], mx.array]) -> mx.array:
        logits = lm_head(hidden)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and float(cap) > 0:
            logits = mx.tanh(logits / cap) * cap
        return logits
