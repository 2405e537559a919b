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

from dflash2_mlx.caches.drafter_context import ContextCache
from dflash2_mlx.kernels import dispatch as kernels
from dflash2_mlx.models.drafter_config import DrafterConfig
from dflash2_mlx.models.drafter_step import DraftStep
from dflash2_mlx.models.selector import CandidateSelector


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


# the checkpoint tensor holding a draft vocabulary's token ids (``Drafter.set_draft_vocab``)
DRAFT_VOCAB_KEY = "draft_vocab"


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
        # None: compute in the stored dtype; float32 on GPUs without native bf16
        # (``drafter_precision``): inputs are cast to it and logits come back in it
        self.activation_dtype: Optional[mx.Dtype] = None
        self._target_dtype: Optional[mx.Dtype] = None  # the target's activations (its embeddings')
        self._draft_vocab: Optional[mx.array] = None  # set_draft_vocab (not a parameter)

    @property
    def draft_vocab(self) -> Optional[mx.array]:
        """The token ids [V'] the drafter scores (sorted), or None for the whole vocabulary."""
        return self._draft_vocab

    def set_draft_vocab(self, token_ids: Optional[mx.array]) -> None:
        """Score only ``token_ids`` (sorted, distinct, in the vocabulary; DFlash 2 only).

        The drafter's head is the target's; on a small target that head is most of a draft's cost
        (SmolLM2: 49152 x 576, a fifth of its weights, read once per draft), while its answers use
        a few thousand distinct tokens. Scoring only those is lossless: verification takes what the
        drafter proposes with the probabilities it proposed them, whatever they are; a token outside
        the draft vocabulary simply cannot be drafted. The logits handed to the selector then have
        one column per draft-vocabulary id, and the selector maps its candidates back to token ids.
        """
        if token_ids is not None and not self.config.is_dflash2:
            raise ValueError("a draft vocabulary needs a DFlash 2 drafter (its selector maps the ids back)")
        self._draft_vocab = token_ids
        if self.config.is_dflash2:
            self.candidate_selector.set_vocab_ids(token_ids)

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
        self._target_dtype = block_embeds.dtype
        return self._step().block(self._to_activations(block_embeds), cache)

    def _to_activations(self, x: mx.array) -> mx.array:
        """Target embeddings or features in the drafter's activation dtype (as is when native)."""
        return x if self.activation_dtype is None else x.astype(self.activation_dtype)

    def absorb(self, features: Optional[mx.array], cache: ContextCache, valid: Optional[mx.array] = None) -> None:
        """Move the target features of newly committed positions [1, n, T*H] into the context
        cache (each cycle's accepted rows; prefill chunks; prefix snapshots). With ``valid``
        [1] int32 (not yet computed), tentatively: only the first ``valid`` rows are kept
        (``ContextCache.commit``)."""
        if features is None or features.shape[1] == 0:
            return
        cache.write(self._step().context_rows(self._to_activations(features), cache.offset), valid)

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
        """The target's ``lm_head`` of the drafter's hidden rows (with the config's multiplier and
        softcap). With float32 activations the head runs in the target's dtype, as the target's
        own logits do (a float32 head would upcast its vocabulary-sized weight per draft), and the
        logits come back in float32 for the selector."""
        if self.activation_dtype is not None and self._target_dtype is not None:
            hidden = hidden.astype(self._target_dtype)
        logits = lm_head(hidden)
        if self.activation_dtype is not None:
            logits = logits.astype(self.activation_dtype)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and float(cap) > 0:
            logits = mx.tanh(logits / cap) * cap
        return logits
