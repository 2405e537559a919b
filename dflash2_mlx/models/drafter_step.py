"""The drafter's decode-time forward: the same computation as ``drafter.py``'s modules, in few ops.

``drafter.py`` holds the weights in the checkpoint's layout and runs training. Decoding runs the
block step and the context-row projection here, arranged for few ops: on MLX's CPU backend every
op costs 5-15 us whatever its size (the main thread wakes the stream thread once per op), and on
Apple GPUs every op is a kernel launch, so at small widths a draft's time is its op count.

- Weights enter pre-transposed (no transpose per matmul): as row-major copies where
  ``blas.row_major_copies_pay`` (float32 on the CPU with OpenBLAS, which would otherwise repack a
  transposed weight on every multi-row matmul), else as views. ``Drafter`` marks them stale
  whenever its parameters are updated, and they are rebuilt before the next step.
- q_norm and k_norm run as one norm over the block's query and key heads, and RoPE once over
  both, with cos/sin rows from a table shared by all layers (``rope.RopeTable``).
- Projections run on 2-D rows (a matmul on 3-D input adds two reshape ops).
- Masks are additive biases, built once per step and added by the score matmul itself.
- The block attends to its context cache and to itself without concatenating them
  (``cpu_attention``).

A test pins this path to the training forward of ``drafter.py`` and to z-lab's reference.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash2_mlx.backend import blas, device
from dflash2_mlx.fastpaths import cpu_attention, rope
from dflash2_mlx.kernels import dispatch as kernels


def _pack_linear(linear: nn.Module, row_major: bool) -> tuple[dict, Optional[tuple]]:
    """(arrays, static meta) of a projection: a dense weight transposed (a row-major copy or a
    view); a quantized one as its packed arrays with (group_size, bits, mode)."""
    if isinstance(linear, nn.QuantizedLinear):
        arrays = {"weight": linear.weight, "scales": linear.scales}
        if "biases" in linear:
            arrays["biases"] = linear.biases
        meta = (linear.group_size, linear.bits, getattr(linear, "mode", "affine"))
    else:
        arrays, meta = {"weight_t": blas.transposed(linear.weight, row_major)}, None
    if "bias" in linear:
        arrays["bias"] = linear.bias
    return arrays, meta


def _linear(x: mx.array, arrays: dict, meta: Optional[tuple]) -> mx.array:
    if meta is None:
        y = x @ arrays["weight_t"]
    else:
        group_size, bits, mode = meta
        y = mx.quantized_matmul(
            x,
            arrays["weight"],
            arrays["scales"],
            arrays.get("biases"),
            transpose=True,
            group_size=group_size,
            bits=bits,
            mode=mode,
        )
    return y + arrays["bias"] if "bias" in arrays else y


class DraftStep:
    """The drafter's block step and context-row projection on packed weights, compiled."""

    def __init__(self, config, fc, hidden_norm, layers, norm, rope_module):
        self.config = config
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.scale = self.head_dim**-0.5
        self.windows = [layer.self_attn.window for layer in layers]
        self.causal = [layer.self_attn.causal for layer in layers]
        self.has_convs = config.is_dflash2
        self._sources = (fc, hidden_norm, layers, norm)
        # Compiled functions read the packed weights as captured inputs: this dict is refilled in
        # place when the drafter's parameters change, so the traces stay valid.
        self.arrays: dict = {}
        self.meta: dict = {}
        self.stale = True
        self.rope_table = rope.RopeTable(rope_module, self.head_dim)
        self._compiled: dict = {}

    def repack(self) -> None:
        """Rebuild the packed weights from the drafter's current parameters."""
        fc, hidden_norm, layers, norm = self._sources
        row_major = blas.row_major_copies_pay(
            m.weight for module in (fc, *layers) for _, m in module.named_modules() if type(m) is nn.Linear
        )
        arrays: dict = {"hidden_norm": hidden_norm.weight, "norm": norm.weight, "layers": []}
        meta: dict = {"layers": []}
        arrays["fc"], meta["fc"] = _pack_linear(fc, row_major)
        for layer in layers:
            attn = layer.self_attn
            a: dict = {
                "input_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "qk_norm": mx.concatenate(
                    [
                        mx.broadcast_to(attn.q_norm.weight, (self.heads, self.head_dim)),
                        mx.broadcast_to(attn.k_norm.weight, (self.kv_heads, self.head_dim)),
                    ]
                ),
                "k_norm": attn.k_norm.weight,
            }
            m: dict = {}
            for name, linear in (
                ("q", attn.q_proj),
                ("k", attn.k_proj),
                ("v", attn.v_proj),
                ("o", attn.o_proj),
                ("gate", layer.mlp.gate_proj),
                ("up", layer.mlp.up_proj),
                ("down", layer.mlp.down_proj),
            ):
                a[name], m[name] = _pack_linear(linear, row_major)
            if self.has_convs:
                for name, conv in (("attention_conv", layer.attention_conv), ("mlp_conv", layer.mlp_conv)):
                    a[name], m[name] = _pack_linear(conv.kernel_projection, row_major)
                    a[name]["base_in"], a[name]["base_out"] = conv.base_kernel[0], conv.base_kernel[1]
            arrays["layers"].append(a)
            meta["layers"].append(m)
        mx.eval(arrays)
        self.arrays.clear()
        self.arrays.update(arrays)
        self.meta = meta
        self.stale = False

    # -- public entry points ------------------------------------------------------------------

    def block(self, block_embeds: mx.array, cache) -> mx.array:
        """Final-normed hidden rows [1, L, H] of the block at the cache's next position on."""
        self._refresh()
        length = block_embeds.shape[1]
        block_pos, bound = cache.next_position()
        table = self.rope_table.covering(bound + length)
        if cache.capacity == 0:
            return self._maybe_compiled("block_alone", self._block)(block_embeds, block_pos, table)
        step = self._maybe_compiled("block", self._block)
        return step(block_embeds, block_pos, table, cache.keys, cache.values, cache.positions)

    def context_rows(self, features: mx.array, offset: int) -> list[tuple[mx.array, mx.array]]:
        """Per layer K/V [1, Hkv, n, D] of new context rows (target features [1, n, T*H])."""
        self._refresh()
        n = features.shape[1]
        table = self.rope_table.covering(offset + n)
        start = mx.array([offset], dtype=mx.int32)
        # a cycle's rows (n <= block size) run compiled; prefill chunks, whose lengths vary with
        # the prompt, do not (each new shape would be traced and kept)
        project = self._context_rows
        if n <= max(self.config.block_size, 16):
            project = self._maybe_compiled("context", self._context_rows)
        return project(features, start, table)

    # -- the computation ----------------------------------------------------------------------

    def _refresh(self) -> None:
        if self.stale:
            self.repack()

    def _maybe_compiled(self, name: str, fn: Callable) -> Callable:
        # the packed arrays are captured inputs: refilled in place, they are seen by the traces
        return kernels.compiled(self._compiled, name, fn, self.arrays)

    @staticmethod
    def _rope_rows(table: mx.array, start: mx.array, length: int, dtype) -> tuple[mx.array, mx.array]:
        """cos, sin [L, 1, D / 2] (positions, heads). The table is float32 and stays so on GPUs,
        where mx.fast.rope (what the training forward calls) computes in float32; on the CPU its
        fallback computes in x's dtype, so the rows are cast to it there (bit for bit)."""
        cos, sin = rope.table_rows(table, start, length)
        if device.cpu_paths():
            cos, sin = cos.astype(dtype), sin.astype(dtype)
        return cos[:, None], sin[:, None]

    def _context_rows(self, features, start, table):
        arrays, meta = self.arrays, self.meta
        n = features.shape[1]
        rows = features.reshape(n, -1)  # 2-D rows: a matmul on 3-D input adds two reshape ops
        context = mx.fast.rms_norm(_linear(rows, arrays["fc"], meta["fc"]), arrays["hidden_norm"], self.eps)
        cos, sin = self._rope_rows(table, start, n, context.dtype)
        kv = []
        for a, m in zip(arrays["layers"], meta["layers"]):
            keys = _linear(context, a["k"], m["k"]).reshape(n, self.kv_heads, self.head_dim)
            keys = rope.apply(mx.fast.rms_norm(keys, a["k_norm"], self.eps), cos, sin)
            values = _linear(context, a["v"], m["v"]).reshape(1, n, self.kv_heads, self.head_dim)
            kv.append((keys[None].transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)))
        return kv

    def _block(self, block_embeds, block_pos, table, keys=None, values=None, positions=None):
        arrays, meta = self.arrays, self.meta
        length = block_embeds.shape[1]
        cos, sin = self._rope_rows(table, block_pos, length, block_embeds.dtype)
        biases = {}  # (window, causal) -> (context bias [L, C] or None, block bias [L, L])
        x = block_embeds  # the residual stream stays [1, L, H] (the convolutions take 3-D)
        for i, (a, m) in enumerate(zip(arrays["layers"], meta["layers"])):
            kind = (self.windows[i], self.causal[i])
            if kind not in biases:
                biases[kind] = (
                    None if keys is None else _context_bias(positions, block_pos, length, kind[0]),
                    mx.array(_block_bias(length, *kind)),
                )
            ctx = None if keys is None else (keys[i], values[i], biases[kind][0])
            x = self._layer(a, m, x, cos, sin, ctx, biases[kind][1])
        return mx.fast.rms_norm(x, arrays["norm"], self.eps)

    def _layer(self, a, m, x, cos, sin, ctx, block_bias):
        b, length, hidden = x.shape
        h = mx.fast.rms_norm(x, a["input_norm"], self.eps)
        if self.has_convs:
            conv_in, conv_out = self._conv_coefficients(h, a["attention_conv"], m["attention_conv"])
            h = kernels.two_tap_conv(h, conv_in, a["attention_conv"]["base_in"])
        h = self._attention(a, m, h.reshape(length, hidden), cos, sin, ctx, block_bias)  # [L, H]
        if self.has_convs:
            h = kernels.two_tap_conv(h.reshape(b, length, hidden), conv_out, a["attention_conv"]["base_out"])
        x = x + h
        h = mx.fast.rms_norm(x, a["post_norm"], self.eps)
        if self.has_convs:
            conv_in, conv_out = self._conv_coefficients(h, a["mlp_conv"], m["mlp_conv"])
            h = kernels.two_tap_conv(h, conv_in, a["mlp_conv"]["base_in"])
        rows = h.reshape(length, hidden)
        h = _linear(
            nn.silu(_linear(rows, a["gate"], m["gate"])) * _linear(rows, a["up"], m["up"]), a["down"], m["down"]
        )
        if self.has_convs:
            h = kernels.two_tap_conv(h.reshape(b, length, hidden), conv_out, a["mlp_conv"]["base_out"])
        return x + h

    def _conv_coefficients(self, h, a, m) -> tuple[mx.array, mx.array]:
        """The dynamic kernels [1, L, K, G] of one sublayer's two convolutions (input, output)."""
        b, length, hidden = h.shape
        taps, groups = a["base_in"].shape[0], hidden // self.config.conv_group_size
        dynamic = _linear(h.reshape(length, hidden), a, m).reshape(b, length, 2 * taps, groups)
        dynamic_in, dynamic_out = mx.split(dynamic, 2, axis=2)
        return dynamic_in, dynamic_out

    def _attention(self, a, m, rows, cos, sin, ctx, block_bias):
        """rows [L, H] -> [L, H]."""
        length = rows.shape[0]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qk = mx.concatenate([_linear(rows, a["q"], m["q"]), _linear(rows, a["k"], m["k"])], axis=-1)
        qk = mx.fast.rms_norm(qk.reshape(length, heads + kv_heads, d), None, self.eps) * a["qk_norm"]
        queries, keys = mx.split(rope.apply(qk, cos, sin), [heads], axis=1)
        values = _linear(rows, a["v"], m["v"]).reshape(length, kv_heads, d)
        out = cpu_attention.block_attention(queries, keys, values, ctx, block_bias, self.scale)
        return _linear(out, a["o"], m["o"])


def _context_bias(positions: mx.array, block_pos: mx.array, length: int, window: Optional[int]) -> mx.array:
    """[L, C] additive mask: 0 where block row i sees context slot c (filled, within the window)."""
    visible = positions[None] >= 0
    if window is not None:
        query = block_pos + mx.array(np.arange(length, dtype=np.int32))[:, None]
        visible = visible & (query - positions[None] < window)
    return mx.where(visible, 0.0, -mx.inf)


def _block_bias(length: int, window: Optional[int], causal: bool) -> np.ndarray:
    """[L, L] additive mask of the block's rows among themselves (the reference's rule: the
    window applies inside the block too, both ways when attention is not causal)."""
    query, key = np.arange(length)[:, None], np.arange(length)[None]
    visible = np.ones((length, length), dtype=bool)
    if causal:
        visible &= key <= query
    if window is not None:
        visible &= (query - key < window) & (key - query < window)
    return np.where(visible, 0.0, -np.inf).astype(np.float32)
