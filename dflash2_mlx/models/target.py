"""TargetRunner: runs an mlx-lm model layer by layer, returning logits and tapped hidden states.

The runner walks the model's own layers and calls their sub-modules; it never patches mlx-lm.
Gated DeltaNet layers (Qwen3.5 / Qwen3.8 hybrids) are walked step by step, computing exactly what
``GatedDeltaNet.__call__`` computes, so that a verify pass can record the recurrence's inputs for
rollback (see ``caches/target.py``). Their gated attention layers, and the attention layers of
Llama / Mistral, Qwen2 and Qwen3 models (what GGUF targets load as), are walked too
(``attention_layers.py``), so that everything but the KV cache update and the attention itself runs
compiled; other attention layers are called as they are. Tests pin the walked layers to mlx-lm's
own forward, bit for bit.

Supported: mlx-lm models whose text stack is ``<model>.layers`` with ``embed_tokens`` and
``norm`` (Qwen3.5-architecture hybrids, Qwen3, Qwen2, Llama, Mistral and similar).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from dflash2_mlx.backend import blas, device
from dflash2_mlx.caches.target import RecurrentInputs, TargetCache, rollback_setting
from dflash2_mlx.fastpaths import rope
from dflash2_mlx.models import attention_layers
from dflash2_mlx.models.attention_layers import mlp, project


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


# Per-step states cost S x [Hv, Dv, Dk] float32 per Gated DeltaNet layer. A 27B model's 16-row
# verify on the CPU keeps 16 x 48 x 128 x 128 x 4 B = 48 MiB per layer (about 2.25 GiB over its 48
# layers, for the length of one pass), within this bound: the CPU keeps them, it does not replay.
# Only larger passes (more rows or heads) replay there; on Metal the recurrence is one kernel and
# rollback replays (``DFLASH2_MLX_ROLLBACK`` overrides both, see caches/target.py).
MAX_KEPT_STATE_BYTES = 64 << 20


def _runs_ops_recurrence(gdn: nn.Module) -> bool:
    """True where our op loop runs the recurrence: wherever mlx-lm would run it as ops (no Metal
    kernel for this layer: its own test). With ``DFLASH2_MLX_PATHS=gpu`` the layer calls mlx-lm's
    ``gated_delta_update`` as on Metal (on the CPU it runs mlx-lm's ops), so tests cover it."""
    if device.forced_gpu_paths():
        return False
    dk = gdn.head_k_dim
    return not (device.metal_gpu() and dk >= 32 and dk % 32 == 0)


def kept_state_bytes(gdn: nn.Module, steps: int) -> int:
    """Bytes of the per-step states a verify pass of ``steps`` rows keeps for one layer."""
    return steps * gdn.num_v_heads * gdn.head_v_dim * gdn.head_k_dim * 4


def _keeps_step_states(gdn: nn.Module, steps: int) -> bool:
    """Whether a verify pass keeps every step's state (rollback picks one) instead of having
    rollback replay: ``DFLASH2_MLX_ROLLBACK`` keep / replay, or (auto) on the ops path within the
    memory bound."""
    setting = rollback_setting()
    if setting != "auto":
        return setting == "keep"
    return _runs_ops_recurrence(gdn) and kept_state_bytes(gdn, steps) <= MAX_KEPT_STATE_BYTES


# Passes of at most this many rows (decode steps, verify blocks) run compiled; prefill chunks,
# whose lengths vary with the prompt, do not (every new shape would be traced and kept).
COMPILED_MAX_ROWS = 16


def _rows_matmul(x: mx.array, weight_t: mx.array) -> mx.array:
    """x [..., H] @ weight_t [H, O] on 2-D rows (a matmul on N-D input adds two reshape ops)."""
    return (x.reshape(-1, x.shape[-1]) @ weight_t).reshape(*x.shape[:-1], -1)


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
    rep = Hv // Hk
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    # Value heads grouped by the key head they read, [.., Hk, rep, ..]: the same products as
    # mlx-lm's mx.repeat of q and k to Hv heads, by broadcasting instead of copying.
    qs = mx.split(q.reshape(B, S, Hk, 1, 1, Dk), S, axis=1)
    ks = mx.split(k.reshape(B, S, Hk, 1, 1, Dk), S, axis=1)
    vs = mx.split(v.reshape(B, S, Hk, rep, Dv, 1), S, axis=1)
    decays = mx.split(g.reshape(B, S, Hk, rep, 1, -1), S, axis=1)  # -1: a scalar or per-Dk decay
    betas = mx.split(beta.reshape(B, S, Hk, rep, 1, 1), S, axis=1)
    state = state.reshape(B, 1, Hk, rep, Dv, Dk)
    ys, states = [], []
    for t in range(S):
        # mlx-lm: state = state * decay; kv_mem = sum(state * k); state = state + k * delta.
        # The decayed state is formed twice, as state * decay and decay * state (the same
        # float product): one shared node would be materialized as its own kernel, two fuse
        # into their consumers, a kernel less per step under mx.compile.
        kv_mem = ((state * decays[t]) * ks[t]).sum(axis=-1, keepdims=True)
        delta = (vs[t] - kv_mem) * betas[t]
        state = (decays[t] * state) + ks[t] * delta
        if keep:
            states.append(state)
        else:
            ys.append((state * qs[t]).sum(axis=-1))
    if keep:  # the outputs of all steps at once from the kept states: same products and sums
        states = mx.concatenate(states, axis=1)
        y = (states * q.reshape(B, S, Hk, 1, 1, Dk)).sum(axis=-1)
        return y.reshape(B, S, Hv, Dv), states.reshape(B, S, Hv, Dv, Dk)
    return mx.concatenate(ys, axis=1).reshape(B, S, Hv, Dv), state.reshape(B, Hv, Dv, Dk)


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

    def __init__(self, model: nn.Module, block_weight_copies: Optional[bool] = None):
        """``block_weight_copies``: multiply block-sized passes (2..16 rows) by row-major copies
        of the layers' dense weights (None: where ``blas.row_major_copies_pay``)."""
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
        # attention layers mlx-lm's classes we know are walked (compiled around the KV cache
        # update, see attention_layers.py): "gated" or "plain"; None: called as they are
        self._walked = [
            attention_layers.walked_kind(layer) if kind == "attention" else None
            for layer, kind in zip(self.layers, self.kinds)
        ]
        # (i, keeps step states) -> compiled gated_delta_layer; ("attention", i) -> the two halves
        self._compiled: dict = {}
        self._weights_t: dict = {}  # layer or "head" -> (the weights they were taken from, views)
        self._rope_tables: dict = {}  # RoPE settings -> rope.RopeTable
        self._head_rows: Optional[tuple] = None  # (token ids, head weight, head_rows' function)
        if block_weight_copies is None:
            block_weight_copies = blas.row_major_copies_pay(
                m.weight for layer in self.layers for _, m in layer.named_modules() if type(m) is nn.Linear
            )
        self.block_weight_copies = block_weight_copies

    def _rope_table(self, attn: nn.Module) -> Optional[rope.RopeTable]:
        """A cos/sin table for the layer's RoPE where it is exact and pays: a plain nn.RoPE
        (rotate-half) on the CPU, where mx.fast.rope runs as ~15 ops per call. Layers with the
        same RoPE settings share one table. None: call the module."""
        module = attn.rope
        if type(module) is not nn.RoPE or module.traditional or not device.cpu_paths():
            return None
        # qwen2 and qwen3 keep no head_dim: their RoPE spans the whole head
        head_dim = getattr(attn, "head_dim", module.dims)
        key = (module.dims, module.base, module.scale, head_dim)
        if key not in self._rope_tables:
            self._rope_tables[key] = rope.RopeTable(module, head_dim, module.dims)
        return self._rope_tables[key]

    def weights_t(self, i: int, rows: int = 1) -> dict:
        """Layer i's dense nn.Linear weights, transposed [in, out], by module path, for a pass of
        ``rows`` rows: passed to the walked layers, they save one transpose op per matmul.

        Views of the weights (nn.Linear's own matmul, bit for bit); for block-sized passes with
        ``block_weight_copies``, row-major copies, which OpenBLAS multiplies without repacking
        (the products and sums of every row stay within float rounding of the views', and a
        verify pass is compared to plain decoding by its tokens, as with the views)."""
        copies = self.block_weight_copies and 1 < rows <= COMPILED_MAX_ROWS
        return self._transposed_views(
            (i, copies), lambda: {path: m for path, m in self.layers[i].named_modules() if type(m) is nn.Linear}, copies
        )

    def _transposed_views(self, key, find: Callable[[], dict], copies: bool = False) -> dict:
        """{path: weight.T} of the modules ``find()`` returns (views, or row-major copies),
        evaluated once and kept under ``key``; rebuilt if a weight was replaced since (a model
        updated in place). The check is a few dict lookups, as it runs for every layer of every
        pass."""
        cached = self._weights_t.get(key)
        if cached is not None and all(m["weight"] is w for m, w in cached[0]):
            return cached[1]
        modules = find()
        views = {path: blas.transposed(m["weight"], copies) for path, m in modules.items()}
        mx.eval(views)
        self._weights_t[key] = ([(m, m["weight"]) for m in modules.values()], views)
        return views

    def rollback_path(self, steps: int = COMPILED_MAX_ROWS) -> str:
        """How a verify pass of ``steps`` rows is rolled back: "keep" (it keeps each step's
        Gated DeltaNet state), "replay" (rollback replays the recurrence) or "trim" (attention
        only: nothing recurrent to roll back). For ``doctor``."""
        gdn = next((layer.linear_attn for layer, kind in zip(self.layers, self.kinds) if kind == "gdn"), None)
        if gdn is None:
            return "trim"
        return "keep" if _keeps_step_states(gdn, steps) else "replay"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def make_cache(self) -> TargetCache:
        return TargetCache(self.kinds)

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's raw token embeddings (no embedding scale, as the drafter expects)."""
        return self.inner.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits of hidden rows [..., H] -> [..., V] (the drafter uses it too). A dense head
        runs as one matmul on 2-D rows with its weight's transposed view: nn.Linear's matmul,
        bit for bit, without the transpose and reshape ops around it."""
        weight_t = self._head_weight_t()
        return self._head(hidden) if weight_t is None else _rows_matmul(hidden, weight_t)

    def head_rows(self, token_ids: mx.array) -> Callable[[mx.array], mx.array]:
        """A head scoring only ``token_ids`` [V']: hidden rows [..., H] -> logits [..., V'], equal
        to ``lm_head(hidden)[..., token_ids]``. It reads a copy of those rows of the head's weight
        (quantized rows stay quantized), made once for a given ``token_ids`` array and head weight
        (every request of a server asks again): the drafter's head with a draft vocabulary
        (``Drafter.set_draft_vocab``)."""
        head = self._head_module
        cached = self._head_rows
        if cached is not None and cached[0] is token_ids and cached[1] is head["weight"]:
            return cached[2]
        fn = self._make_head_rows(head, token_ids)
        self._head_rows = (token_ids, head["weight"], fn)
        return fn

    def _make_head_rows(self, head: nn.Module, token_ids: mx.array) -> Callable[[mx.array], mx.array]:
        if type(head) in (nn.Linear, nn.Embedding) and "bias" not in head:
            rows_t = head.weight[token_ids].T  # [H, V']
            mx.eval(rows_t)
            return lambda hidden: _rows_matmul(hidden, rows_t)
        if type(head) in (nn.QuantizedLinear, nn.QuantizedEmbedding) and "bias" not in head:
            weight, scales = head.weight[token_ids], head.scales[token_ids]
            biases = head["biases"][token_ids] if "biases" in head else None
            mx.eval([a for a in (weight, scales, biases) if a is not None])
            mode = getattr(head, "mode", "affine")

            def quantized_rows(hidden: mx.array) -> mx.array:
                return mx.quantized_matmul(
                    hidden,
                    weight,
                    scales,
                    biases,
                    transpose=True,
                    group_size=head.group_size,
                    bits=head.bits,
                    mode=mode,
                )

            return quantized_rows
        # any other head (a bias, a custom class): the whole head, then the columns
        return lambda hidden: mx.take(self.lm_head(hidden), token_ids, axis=-1)

    @property
    def _head_module(self) -> nn.Module:
        """The module holding the head's weight (the embedding when tied)."""
        return self.inner.embed_tokens if self._tied else self.outer.lm_head

    @property
    def _head(self) -> Callable[[mx.array], mx.array]:
        return self.inner.embed_tokens.as_linear if self._tied else self.outer.lm_head

    def _head_weight_t(self) -> Optional[mx.array]:
        head = self._head_module
        if type(head) not in (nn.Linear, nn.Embedding) or "bias" in head:
            return None
        return self._transposed_views("head", lambda: {"head": head})["head"]

    def _final_logits(self, h: mx.array) -> mx.array:
        """lm_head(norm(h)): compiled for block-sized inputs (the norm's ops fuse). The norm's and
        the head's parameters and the head's transposed view are inputs of the trace, so a model
        updated in place is seen."""
        if h.shape[1] > COMPILED_MAX_ROWS:
            return self.lm_head(self.inner.norm(h))
        weight_t = self._head_weight_t()
        fn = self._compiled.get("head")
        if fn is None:
            inputs = [self.inner.norm.state, self._head_module.state]
            fn = self._compiled["head"] = mx.compile(self._norm_and_head, inputs=inputs)
        return fn(h) if weight_t is None else fn(h, weight_t)

    def _norm_and_head(self, h: mx.array, *weight_t: mx.array) -> mx.array:
        x = self.inner.norm(h)
        return _rows_matmul(x, weight_t[0]) if weight_t else self._head(x)

    def __call__(
        self,
        tokens: mx.array,
        cache: TargetCache,
        taps: Optional[list[int]] = None,
        record: Optional[list[RecurrentInputs]] = None,
        logits_from: int = 0,
    ) -> tuple[mx.array, Optional[mx.array]]:
        """Feed ``tokens`` [1, L] after what ``cache`` holds (or, from ``batched_verify``, the
        blocks of several sequences [N, L] after a batch view of their caches).

        Returns logits [1, L - logits_from, V] (rows that are never read are not computed; None
        when logits_from >= L) and,
        when ``taps`` is given, the concatenated outputs of those layers [1, L, len(taps) * H].
        With ``record`` (a list), Gated DeltaNet layers append what rollback needs.
        """
        h = self.inner.embed_tokens(tokens)
        mask = None
        if self._attention_index is not None:
            mask = create_attention_mask(h, cache[self._attention_index])
            if (
                isinstance(mask, str)
                and mask == "causal"
                and tokens.shape[1] <= COMPILED_MAX_ROWS
                and device.cpu_paths()
            ):
                # the boolean mask MLX's CPU attention builds from "causal" in every layer (a few
                # ops each), made once on the host: the same where(mask, scores, -inf) follows
                offset, rows = cache[self._attention_index].offset, tokens.shape[1]
                mask = mx.array(np.arange(offset + rows)[None] <= offset + np.arange(rows)[:, None])
        tapped = {}
        wanted = set(taps or ())
        rope_rows: dict = {}  # this pass's cos/sin rows per RoPE table, shared by the layers
        for i, (layer, kind) in enumerate(zip(self.layers, self.kinds)):
            if kind == "gdn":
                h = self._gated_delta_layer(i, layer, h, cache[i], record)
            elif self._walked[i]:
                h = self._attention_layer(i, layer, h, mask, cache[i], rope_rows)
            else:
                h = layer(h, mask=mask, cache=cache[i])
            if i in wanted:
                tapped[i] = h
        cache.advance(tokens.shape[1])
        logits = None
        if logits_from < tokens.shape[1]:
            logits = self._final_logits(h[:, logits_from:] if logits_from else h)
        features = mx.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
        return logits, features

    def _attention_layer(self, i: int, layer: nn.Module, h: mx.array, mask, cache, rope_rows: dict) -> mx.array:
        """A walked attention decoder layer: the half before the KV cache update (norm,
        projections, RoPE) and the half after it (output projection, MLP, residuals) run compiled
        (one trace per row count), the cache update and the attention itself as mlx-lm does them."""
        offset = mx.array(cache.offset, dtype=mx.int32)
        table = self._rope_table(layer.self_attn)
        rows = ()
        if table is not None:
            if table not in rope_rows:
                rope_rows[table] = _pass_rope_rows(table, cache, h.shape[1])
            rows = rope_rows[table]
        inputs, output = attention_layers.HALVES[self._walked[i]]
        if h.shape[1] <= COMPILED_MAX_ROWS:
            before, after = self._compiled.get(("attention", i), (None, None))
            if before is None:
                before = mx.compile(partial(inputs, layer), inputs=layer.state)
                after = mx.compile(partial(output, layer), inputs=layer.state)
                self._compiled[("attention", i)] = (before, after)
        else:
            before, after = partial(inputs, layer), partial(output, layer)
        weights_t = self.weights_t(i, h.shape[1])
        # queries, keys, values and, for gated attention, the output gate (passed on to ``after``)
        queries, keys, values, *rest = before(h, offset, weights_t, rows)
        keys, values = cache.update_and_fetch(keys, values)
        attn = layer.self_attn
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        return after(h, out, *rest, weights_t)

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
        weights_t = self.weights_t(i, steps)
        if state is not None and steps <= COMPILED_MAX_ROWS and not gdn.training:
            fn = self._compiled.get((i, keep))
            if fn is None:
                fn = mx.compile(partial(gated_delta_layer, layer, keep=keep), inputs=layer.state)
                self._compiled[(i, keep)] = fn
            h, (conv_input, q, k, v, a, b), new_state, states = fn(h, conv_state, state, weights_t)
        else:
            h, (conv_input, q, k, v, a, b), new_state, states = gated_delta_layer(
                layer, h, conv_state, state, weights_t, keep
            )
        conv_state = conv_input[:, -(gdn.conv_kernel_size - 1) :, :]
        # a copy frees a prefill chunk's whole conv input (mlx-lm copies always); a block's is a
        # few rows, and the view saves an op per layer per pass
        cache[0] = conv_state if steps <= COMPILED_MAX_ROWS else mx.contiguous(conv_state)
        cache[1] = new_state
        cache.advance(steps)
        if record is not None:
            record.append(
                RecurrentInputs(conv_input, q, k, v, a, b, state, gdn.A_log, gdn.dt_bias, states if keep else None)
            )
        return h


def _pass_rope_rows(table: rope.RopeTable, cache, rows: int) -> tuple[mx.array, mx.array]:
    """cos, sin of a pass's positions after ``cache``: [rows, dims / 2] for one sequence, or
    [N, 1, rows, dims / 2] after a batch of sequences (``batched_verify.RaggedKV``: an offset per
    sequence, int32 [N], and ``starts``, the same as ints)."""
    if isinstance(cache.offset, int):
        start = mx.array([cache.offset], dtype=mx.int32)
        return rope.table_rows(table.covering(cache.offset + rows), start, rows)
    return rope.table_rows_at(table.covering(max(cache.starts) + rows), cache.offset, rows)


def gated_delta_layer(
    layer: nn.Module,
    h: mx.array,
    conv_state: mx.array,
    state: Optional[mx.array],
    weights_t: Optional[dict] = None,
    keep: bool = False,
):
    """A Qwen3.5/3.8 Gated DeltaNet decoder layer on ``h`` [1, S, H]; a pure function, so that it
    can be compiled -> (output rows, the recurrence's inputs (conv_input, q, k, v, a, b), the state
    after the pass, and with ``keep`` the state after every step [1, S, Hv, Dv, Dk] (else [])).

    Mirrors mlx_lm.models.qwen3_5 (DecoderLayer and GatedDeltaNet.__call__) for an unpadded batch
    of one; a test pins the two to identical outputs and states. ``weights_t``: transposed views
    of the dense projections' weights by path (``TargetRunner.weights_t``), or None.
    """
    gdn = layer.linear_attn
    B, S, H = h.shape
    rows = h.reshape(B * S, H)  # 2-D rows: each projection is then one matmul, no reshapes around it
    x = layer.input_layernorm(rows)
    qkv = project(x, layer, "linear_attn.in_proj_qkv", weights_t).reshape(B, S, -1)
    z = project(x, layer, "linear_attn.in_proj_z", weights_t).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b = project(x, layer, "linear_attn.in_proj_b", weights_t).reshape(B, S, -1)
    a = project(x, layer, "linear_attn.in_proj_a", weights_t).reshape(B, S, -1)
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
    rows = rows + project(out.reshape(B * S, -1), layer, "linear_attn.out_proj", weights_t)
    rows = rows + mlp(layer, layer.post_attention_layernorm(rows), weights_t)
    return rows.reshape(B, S, H), (conv_input, q, k, v, a, b), new_state, states
