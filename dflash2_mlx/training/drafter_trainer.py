"""Train a DFlash 2 (or DFlash 1) drafter against a frozen target, with the DFlash recipe.

The recipe
----------
- Data: sequences whose tail is the target's own greedy continuation (``data.py``). Anchors are
  drawn per sequence and step, uniformly among positions ``a`` with ``a >= max(1,
  continuation_start)`` (inside the generated part, with at least one context row) and
  ``a + B - 1 < S`` (room for the block).
- Block: ``[seq[a], MASK, ..., MASK]`` at positions a..a+B-1, embedded with the target's frozen
  embedding (times ``input_embedding_scale``). Context: the target's tapped hidden states of the
  positions strictly before ``a`` (computed once by the frozen target, no gradient).
  ``Drafter.train_forward`` gives every block exactly what inference shows it: its own context
  prefix (within the sliding window) and its own rows both ways, never another block.
- Labels: row i (1..B-1) predicts ``seq[a + i]``, the target's own greedy output. Loss:
  cross-entropy on rows 1..B-1 weighted by ``exp(-(i - 1) / gamma)``, weights normalised to sum
  to one per block, averaged over blocks.
- Selector (DFlash 2): row i's candidates are the top-k of its (stop-gradient) drafter logits,
  its predecessor is the true token of row i-1 (the anchor for row 1, as in the greedy walk up to
  the first miss), scores ``unary + <pred_cb[pred] * hidden_projection(h_i), succ_cb[cand]>``;
  cross-entropy against the index of the true label among the candidates, rows whose label is
  not among them masked out, with the same row weights, added with ``selector_loss_weight``.
  By default the selector loss does not reach the drafter (``selector_grad_to_drafter=False``):
  the unary scores and h_i are stop-gradient, so the selector is a pure re-ranker that learns the
  pair correction log p(b | a, h) - log p(b | h) on top of whatever the drafter proposes, and the
  drafter is shaped by the cross-entropy alone. The selector's gradients are also clipped on
  their own, so a DFlash 2 run trains bit for bit the drafter its selector-off ablation trains.
  Measured on a byte-level tiny target (B = 8, 600 steps, held-out anchor-mean tau): detached
  6.17, joint 6.08; at 300 steps joint led by 0.1. No gain worth losing the clean ablation.
- Initialisation: identity convolutions (``base_kernel[:, 0] = 1``, ``[:, 1] = 0``), zero dynamic
  projections, zero successor codebook, small random predecessor codebook and hidden projection;
  every other layer MLX's default init, norms ones. The frozen target's embedding and LM head
  are shared: the checkpoint has neither.
- Optimiser: AdamW (betas 0.9 / 0.95, bias correction), linear warmup then cosine decay,
  gradient-norm clipping (drafter and selector each on their own). The step is ``mx.compile``d
  (about 8% faster than eager at the embedded pair's widths on this CPU; same weights to 1e-5).

Ablations at equal budget ("DFlash 1", "+ selector", "+ convs", "+ both")
----------------------------------------------------------------------------
- both off: a real DFlash 1 checkpoint (``DFlashDraftModel``: no convs, no selector tensors).
- convs off (``convs=False``): a DFlash 2 checkpoint whose convolutions are frozen at the identity
  (tap 0 = 1, tap 1 = 0, zero dynamic projection). ``1 * x_t + 0 * x_(t-1)`` is exactly ``x_t``,
  so the network computes bit for bit what a drafter without convs computes; it stays loadable by
  everything that loads DFlash 2 (it pays the identity convs' small cost at inference).
- selector off (``selector=False``): a DFlash 2 checkpoint whose selector is frozen at zero
  (codebooks and projection). Every pair score is then exactly the unary logit, so the greedy
  walk is the drafter's per-row argmax (top-k is sorted, first maximum): DFlash 1's greedy
  proposal. With sampling it proposes softmax(logits / T) truncated to the top-k, which is what a
  DFlash 2 engine does without a trained selector; acceptance tables at temperature 0 are exact.
  No selector loss is computed.

Measured (a byte-level 128-wide 4-layer tiny target trained briefly on Python source, 1024
sequences of 64 corpus + 24 generated tokens, 600 steps, B = 8, held-out greedy tokens per cycle
from ``evaluate_drafter``): DFlash 1 4.16, + selector 4.69, + convs 5.08, + both 5.20.

Checkpoints and resume
----------------------
``out_dir`` gets ``config.json`` + ``model.safetensors`` in the real layout (float32; loadable by
``loading.load_drafter`` and z-lab's ``DFlash2DraftModel.from_pretrained``) every
``checkpoint_every`` steps, at the end, and when interrupted (Ctrl-C). The optimiser state and the
step live in ``out_dir/training_state/`` (a subdirectory, so no loader ever globs them as weights).
Calling ``train_drafter`` again on the same ``out_dir`` resumes: all randomness is derived from
``(seed, step)``, so a run stopped after k steps and resumed gives bit for bit the weights of an
uninterrupted run with the same step budget. ``minutes`` budgets (and ``stop_at_step``) end a
run by the clock / at a step; the schedule of a minutes run follows elapsed time, so such a run is
not deterministic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.drafter_config import DFLASH1, DFLASH2, DrafterConfig, build_target_layer_ids
from dflash2_mlx.models.selector import top_k_candidates

__all__ = [
    "DrafterTrainingConfig",
    "train_drafter",
    "default_target_layer_ids",
    "make_drafter_config",
    "init_drafter",
    "sample_anchors",
    "batch_indices",
    "loss_weights",
    "block_arrays",
    "forward_blocks",
    "drafter_loss",
    "block_target_logits",
    "summarize",
    "evaluate_drafter",
    "greedy_walk_correct",
    "simulated_cycles",
    "load_checkpoint_state",
    "STATE_DIR",
]

STATE_DIR = "training_state"
DEFAULT_STEPS = 1000
MASK_TOKEN = "<|mask|>"


@dataclass
class DrafterTrainingConfig:
    # architecture
    block_size: int = 8
    layers: int = 2
    convs: bool = True
    selector: bool = True
    target_layer_ids: Optional[list[int]] = None  # None: evenly spread non-final layers
    num_taps: Optional[int] = None  # None: one per drafter layer (the reference's rule)
    intermediate_size: Optional[int] = None  # None: the target's
    num_attention_heads: Optional[int] = None  # None: the target's
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    sliding_window: Optional[int] = 2048  # the real drafter's layout; None: full attention
    conv_group_size: int = 16
    conv_kernel_size: int = 2
    selector_top_k: int = 16
    selector_rank: int = 32
    mask_token_id: Optional[int] = None  # None: the tokenizer's "<|mask|>"
    # budget
    steps: Optional[int] = None  # None with minutes None: DEFAULT_STEPS
    minutes: Optional[float] = None  # wall-clock budget (not deterministic)
    stop_at_step: Optional[int] = None  # end this run early, as an interruption would (resume later)
    seed: int = 0
    # optimisation
    learning_rate: float = 3e-3
    min_learning_rate_ratio: float = 0.1
    warmup_fraction: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int = 8  # sequences per step
    blocks_per_sequence: int = 16  # anchors per sequence per step
    gamma: Optional[float] = None  # loss decay along the block; None: 7 / 5 / 4 for B = 16 / 10 / 8
    selector_loss_weight: float = 1.0
    # share of each row's loss from the target's whole next-token distribution (cross-entropy to
    # its softmax: KL up to the target's entropy), the rest from the label; 0: labels only
    soft_target_weight: float = 0.0
    selector_grad_to_drafter: bool = False
    selector_init_std: float = 0.1
    # machinery
    compile: bool = True
    feature_cache_bytes: int = 2 << 30  # precompute the target's features when they fit
    checkpoint_every: int = 200
    log_every: int = 10

    def resolved_gamma(self) -> float:
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2))

    @property
    def architecture(self) -> str:
        return DFLASH2 if (self.convs or self.selector) else DFLASH1

    def validate(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block size must be at least 2, got {self.block_size}")
        if self.layers < 1:
            raise ValueError(f"layers must be at least 1, got {self.layers}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if self.batch_size < 1 or self.blocks_per_sequence < 1:
            raise ValueError("batch_size and blocks_per_sequence must be at least 1")
        if not self.learning_rate > 0:
            raise ValueError(f"learning rate must be positive, got {self.learning_rate}")
        if not 0.0 <= self.soft_target_weight <= 1.0:
            raise ValueError(f"soft_target_weight must be in [0, 1], got {self.soft_target_weight}")
        if self.selector and self.selector_top_k < 2:
            raise ValueError(f"selector_top_k must be at least 2, got {self.selector_top_k}")

    @property
    def total_steps(self) -> Optional[int]:
        """The step budget the schedule plans for (None: a minutes-only run)."""
        if self.steps is not None:
            return self.steps
        return None if self.minutes is not None else DEFAULT_STEPS


# Fields that may change between a run and its resumption (budget and bookkeeping only).
_RESUMABLE_CHANGES = {"steps", "minutes", "stop_at_step", "compile", "feature_cache_bytes", "checkpoint_every", "log_every"}


# ---------------------------------------------------------------------------------------------
# Building the drafter
# ---------------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` distinct taps spread over the target's layers, never its last one.

    The reference's rule (``build_target_layer_ids``: from layer 1 to layer n-3) when it gives
    distinct non-final layers, else evenly spread over 0..n-2. The last layer is never tapped:
    transformers reports it final-normed, so implementations would disagree about its feature.
    """
    n = int(num_target_layers)
    if n < 2:
        raise ValueError(f"the target has {n} layer(s); a drafter needs a non-final layer to tap")
    count = max(1, min(int(count), n - 1))
    ids = build_target_layer_ids(n, count)
    if len(set(ids)) == count and all(0 <= i <= n - 2 for i in ids):
        return [int(i) for i in ids]
    start = 1 if n - 2 >= count else 0
    ids = sorted({int(round(x)) for x in np.linspace(start, n - 2, count)})
    if len(ids) < count:
        ids = list(range(n - 1 - count, n - 1))
    return ids


def _text_config(target) -> dict:
    cfg = getattr(target, "config", None) or {}
    return cfg.get("text_config", cfg)


def mask_token_for(target, override: Optional[int] = None) -> int:
    if override is not None:
        return int(override)
    tokenizer = getattr(target, "tokenizer", None)
    vocab = {}
    if tokenizer is not None:
        try:
            vocab = tokenizer.get_vocab()
        except Exception:  # tokenizers without get_vocab: fall through to the error
            vocab = {}
    if MASK_TOKEN not in vocab:
        raise ValueError(
            f"the target's tokenizer has no {MASK_TOKEN} token; the drafter needs a mask token id: "
            f"add {MASK_TOKEN} to the tokenizer (an unused special token id works) or set mask_token_id"
        )
    return int(vocab[MASK_TOKEN])


def make_drafter_config(target, config: DrafterTrainingConfig) -> DrafterConfig:
    """The drafter's config.json (as a DrafterConfig) for this target and training config."""
    runner = target.runner
    text = _text_config(target)
    hidden = runner.hidden_size
    vocab = runner.vocab_size or int(text["vocab_size"])
    heads = int(config.num_attention_heads or text.get("num_attention_heads") or max(1, hidden // 64))
    kv_heads = int(config.num_key_value_heads or (text.get("num_key_value_heads") if not config.num_attention_heads else None) or heads)
    head_dim = int(config.head_dim or (text.get("head_dim") if not config.num_attention_heads else None) or hidden // heads)
    rope = text.get("rope_parameters") or {}
    rope_theta = float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    taps = config.target_layer_ids
    if taps is None:
        taps = default_target_layer_ids(runner.num_layers, config.num_taps or config.layers)
    bad = [t for t in taps if not 0 <= t < runner.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {taps} are outside the target's {runner.num_layers} layers")
    mask = mask_token_for(target, config.mask_token_id)
    if not 0 <= mask < vocab:
        raise ValueError(f"mask token id {mask} is outside the target's vocabulary (size {vocab})")
    dflash: dict[str, Any] = {"block_size": config.block_size, "mask_token_id": mask, "target_layer_ids": list(taps)}
    if config.architecture == DFLASH2:
        if hidden % config.conv_group_size:
            raise ValueError(f"hidden size {hidden} is not a multiple of conv_group_size {config.conv_group_size}")
        dflash.update(
            conv_group_size=config.conv_group_size, conv_kernel_size=config.conv_kernel_size,
            selector_rank=config.selector_rank, selector_top_k=config.selector_top_k,
        )
    dflash["target_model"] = target.name
    raw: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": "qwen3",
        "dflash_config": dflash,
        "hidden_size": hidden,
        "intermediate_size": int(config.intermediate_size or text.get("intermediate_size") or 4 * hidden),
        "num_hidden_layers": config.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(text.get("max_position_embeddings", 32768)),
        "num_target_layers": runner.num_layers,
        "is_causal": False,
        "dtype": "float32",
    }
    if config.sliding_window:
        raw["layer_types"] = ["sliding_attention"] * config.layers
        raw["sliding_window"] = int(config.sliding_window)
    else:
        raw["layer_types"] = ["full_attention"] * config.layers
    return DrafterConfig.from_dict(raw)


def init_drafter(drafter_config: DrafterConfig, config: DrafterTrainingConfig) -> Drafter:
    """A drafter initialised as the recipe says (deterministic for ``config.seed``)."""
    mx.random.seed(config.seed)
    drafter = Drafter(drafter_config)
    if drafter_config.is_dflash2:
        _reset_convs(drafter)
        sel = drafter.candidate_selector
        k1, k2 = mx.random.split(mx.random.key(config.seed + 1))
        std = config.selector_init_std
        sel.predecessor_codebook = std * mx.random.normal(sel.predecessor_codebook.shape, key=k1)
        sel.successor_codebook = mx.zeros_like(sel.successor_codebook)
        w = sel.hidden_projection.weight
        sel.hidden_projection.weight = std * mx.random.normal(w.shape, key=k2)
        if not config.selector:
            _zero_selector(drafter)
    mx.eval(drafter.parameters())
    return drafter


def _reset_convs(drafter: Drafter) -> None:
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = mx.zeros(conv.base_kernel.shape)
            conv.base_kernel = base.at[:, 0, :].add(1.0)
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)


def _zero_selector(drafter: Drafter) -> None:
    sel = drafter.candidate_selector
    sel.predecessor_codebook = mx.zeros_like(sel.predecessor_codebook)
    sel.successor_codebook = mx.zeros_like(sel.successor_codebook)
    sel.hidden_projection.weight = mx.zeros_like(sel.hidden_projection.weight)


def _freeze_ablations(drafter: Drafter, config: DrafterTrainingConfig) -> None:
    """convs / selector off in a DFlash 2 drafter: fixed at identity / zero and not trained."""
    if not drafter.config.is_dflash2:
        return
    if not config.convs:
        for layer in drafter.layers:
            layer.attention_conv.freeze()
            layer.mlp_conv.freeze()
    if not config.selector:
        drafter.candidate_selector.freeze()


def _drafter_from_init(target, init: Path, config: DrafterTrainingConfig) -> Drafter:
    """Start from an existing drafter (DFlash 1 or 2); a DFlash 1 init can grow DFlash 2 parts."""
    from dflash2_mlx.models.loading import load_drafter, validate_pair

    source = load_drafter(str(init))
    sc = source.config
    validate_pair(target.runner, sc)
    if sc.num_hidden_layers != config.layers:
        warnings.warn(f"--init drafter has {sc.num_hidden_layers} layers; training it with that many, not {config.layers}")
    if sc.is_dflash2 and config.architecture == DFLASH1:
        raise ValueError("cannot train a DFlash 1 drafter from a DFlash 2 --init (drop --no-convs or --no-selector)")
    raw = sc.to_dict()
    dflash = raw["dflash_config"]
    dflash["block_size"] = config.block_size
    dflash["target_model"] = target.name
    raw["architectures"] = [config.architecture]
    raw["dtype"] = "float32"
    if config.architecture == DFLASH2 and not sc.is_dflash2:
        dflash.update(
            conv_group_size=config.conv_group_size, conv_kernel_size=config.conv_kernel_size,
            selector_rank=config.selector_rank, selector_top_k=config.selector_top_k,
        )
    elif config.architecture == DFLASH2:
        dflash["selector_top_k"] = config.selector_top_k
    dc = DrafterConfig.from_dict(raw)
    drafter = init_drafter(dc, dataclasses.replace(config, layers=sc.num_hidden_layers))
    weights = [(k, v.astype(mx.float32)) for k, v in tree_flatten(source.parameters())]
    drafter.load_weights(weights, strict=False)
    if dc.is_dflash2 and not config.convs:
        _reset_convs(drafter)
    if dc.is_dflash2 and not config.selector:
        _zero_selector(drafter)
    mx.eval(drafter.parameters())
    return drafter


# ---------------------------------------------------------------------------------------------
# Data for one step (all randomness derived from (seed, step))
# ---------------------------------------------------------------------------------------------


def _rng(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(step), int(stream)])


def batch_indices(num_sequences: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Sequence indices of one step: epochs of seeded permutations, read in order."""
    positions = step * batch_size + np.arange(batch_size)
    epochs, offsets = positions // num_sequences, positions % num_sequences
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        perm = _rng(seed, int(epoch), 1).permutation(num_sequences)
        sel = epochs == epoch
        out[sel] = perm[offsets[sel]]
    return out


def anchor_range(seq_len: int, block_size: int, continuation_start: int) -> tuple[int, int]:
    """Inclusive [lo, hi] of valid anchors: inside the generated part, one context row at least,
    and room for the whole block (the last row predicts position a + B - 1 < seq_len)."""
    lo = max(1, int(continuation_start))
    hi = seq_len - block_size
    if hi < lo:
        raise ValueError(
            f"sequences of {seq_len} tokens leave no room for a block of {block_size} after position "
            f"{lo} (continuation_start {continuation_start}); generate longer continuations"
        )
    return lo, hi


def sample_anchors(rng: np.random.Generator, seq_len: int, block_size: int, count: int, continuation_start: int) -> np.ndarray:
    """``count`` sorted anchor positions for one sequence (distinct when there are enough)."""
    lo, hi = anchor_range(seq_len, block_size, continuation_start)
    choices = hi - lo + 1
    picks = rng.choice(choices, size=count, replace=count > choices)
    return np.sort(picks + lo).astype(np.int32)


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
    """[B-1] weights of rows 1..B-1: exp(-(i - 1) / gamma), normalised to sum to one."""
    w = np.exp(-np.arange(block_size - 1, dtype=np.float64) / float(gamma))
    return (w / w.sum()).astype(np.float32)


def block_arrays(sequences: np.ndarray, anchors: np.ndarray, block_size: int, mask_token_id: int):
    """(block tokens [n, N, B], labels [n, N, B-1], predecessors [n, N, B-1]) for anchors [n, N]."""
    rows = np.arange(block_size)
    pos = anchors[..., None] + rows  # [n, N, B]
    seq = sequences[np.arange(len(sequences))[:, None, None], pos]
    blocks = np.full(pos.shape, mask_token_id, dtype=np.int32)
    blocks[..., 0] = seq[..., 0]
    return blocks, seq[..., 1:].astype(np.int32), seq[..., :-1].astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Forward and loss
# ---------------------------------------------------------------------------------------------


def forward_blocks(drafter: Drafter, embed, features: mx.array, blocks: mx.array, anchors: mx.array) -> mx.array:
    """Final-normed hidden rows [n*N, B, H] of N blocks for each of n sequences.

    features [n, S, T*H] (frozen target taps), blocks [n, N, B] token ids, anchors [n, N].
    One ``train_forward`` per sequence: each block sees its own context prefix and itself only.
    """
    scale = drafter.config.input_embedding_scale
    out = []
    for j in range(blocks.shape[0]):
        embeds = embed(blocks[j]) * scale if scale != 1.0 else embed(blocks[j])
        out.append(drafter.train_forward(embeds, mx.stop_gradient(features[j : j + 1]), anchors[j]))
    return mx.concatenate(out, axis=0)


def block_target_logits(lm_head, final: mx.array, anchors: mx.array, block_size: int) -> mx.array:
    """The target's logits [n*N, B-1, V] for the scored rows of blocks at ``anchors`` [n, N].

    ``final`` [n, S, H]: the target's final-normed last hidden states of the n sequences. Row i
    (1..B-1) predicts position a + i, which the target predicts from position a + i - 1.
    """
    positions = anchors[..., None] + mx.arange(block_size - 1)  # [n, N, B-1]
    rows = final[mx.arange(final.shape[0])[:, None, None], positions]  # [n, N, B-1, H]
    return lm_head(rows.reshape(-1, block_size - 1, rows.shape[-1]))


def selector_scores(selector, hidden: mx.array, candidates: mx.array, unary: mx.array, predecessors: mx.array) -> mx.array:
    """Teacher-forced pair scores [M, R, k]: row i's candidates after the true token of row i-1."""
    left = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)  # [M, R, r]
    right = selector.successor_codebook[candidates]  # [M, R, k, r]
    return unary + (right @ left[..., None])[..., 0]


def _leading_run(correct: mx.array) -> mx.array:
    """Per block, how many leading rows are right: the accepted count of a greedy cycle."""
    return mx.cumprod(correct.astype(mx.float32), axis=-1).sum(axis=-1)


def drafter_loss(
    drafter: Drafter,
    lm_head,
    hidden: mx.array,
    labels: mx.array,
    predecessors: mx.array,
    weights: mx.array,
    config: DrafterTrainingConfig,
    target_logits: Optional[mx.array] = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """(total loss, metrics) from the block hidden rows [M, B, H] (row 0 = anchor, not scored).

    ``target_logits`` [M, B-1, V]: the frozen target's logits for the rows' positions; with
    ``config.soft_target_weight`` > 0 that share of each row's cross-entropy is taken against
    the target's softmax instead of the label (metric ``soft``: that soft cross-entropy).

    metrics: ce, sel (selector loss), acc (drafter top-1), sel_acc (selector top-1 with the true
    predecessor), hit (label within the top-k: the rows the selector loss counts), tau / tau_top1
    (1 + leading correct rows: the acceptance length a greedy cycle would get on these blocks,
    with / without the selector). Every metric is a distinct array and the total is not among
    them (mx.compile of a gradient fails on duplicated outputs; ``summarize`` adds both back).
    """
    h = hidden[:, 1:]
    logits = drafter.logits(h, lm_head)  # [M, R, V]
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")  # [M, R]
    soft = None
    if target_logits is not None and config.soft_target_weight > 0:
        teacher = mx.softmax(mx.stop_gradient(target_logits).astype(mx.float32), axis=-1)
        soft = -(teacher * nn.log_softmax(logits, axis=-1)).sum(axis=-1)  # [M, R]
        ce = (1.0 - config.soft_target_weight) * ce + config.soft_target_weight * soft
    ce_loss = (ce * weights).sum(axis=-1).mean()
    top1 = mx.argmax(logits, axis=-1) == labels
    metrics = {"ce": ce_loss, "acc": top1.astype(mx.float32).mean(), "tau_top1": 1.0 + _leading_run(top1).mean()}
    if soft is not None:
        metrics["soft"] = (soft * weights).sum(axis=-1).mean()
    total = ce_loss
    if drafter.config.is_dflash2:
        sel = drafter.candidate_selector
        detached = mx.stop_gradient(logits)
        candidates, unary = top_k_candidates(detached, sel.top_k)
        if config.selector_grad_to_drafter:
            unary = mx.take_along_axis(logits, candidates, axis=-1)
            sel_hidden = h
        else:
            sel_hidden = mx.stop_gradient(h)
        scores = selector_scores(sel, sel_hidden, candidates, unary, predecessors)
        hit = candidates == labels[..., None]
        valid = hit.any(axis=-1)
        index = mx.argmax(hit.astype(mx.int32), axis=-1)
        chosen = mx.argmax(scores, axis=-1)
        right = valid & (chosen == index)
        metrics.update(
            sel_acc=right.astype(mx.float32).mean(),
            hit=valid.astype(mx.float32).mean(),
            tau=1.0 + _leading_run(right).mean(),
        )
        if config.selector:
            sce = nn.losses.cross_entropy(scores, index, reduction="none")
            w = weights * valid.astype(mx.float32)
            sel_loss = (sce * w).sum() / mx.maximum(w.sum(), 1e-6)
            total = total + config.selector_loss_weight * sel_loss
            metrics["sel"] = sel_loss
    return total, metrics


def summarize(metrics: dict[str, float], config: DrafterTrainingConfig) -> dict[str, float]:
    """Metrics as floats with the total loss and tau (DFlash 1: the top-1 walk) filled in."""
    m = dict(metrics)
    m["loss"] = m["ce"] + (config.selector_loss_weight * m["sel"] if "sel" in m else 0.0)
    m.setdefault("tau", m["tau_top1"])
    return m


def greedy_walk_correct(drafter: Drafter, lm_head, hidden: mx.array, labels: mx.array, predecessors: mx.array) -> mx.array:
    """[M, R] bool: which rows the greedy walk gets right given the true predecessors.

    DFlash 2: the selector's pick among the row's top-k; DFlash 1: the row's argmax. Up to the
    first miss the walk's predecessors are the true tokens, so the leading run of this matrix is
    exactly what a greedy verify cycle accepts.
    """
    h = hidden[:, 1:]
    logits = drafter.logits(h, lm_head)
    if not drafter.config.is_dflash2:
        return mx.argmax(logits, axis=-1) == labels
    sel = drafter.candidate_selector
    candidates, unary = top_k_candidates(logits, sel.top_k)
    scores = selector_scores(sel, h, candidates, unary, predecessors)
    chosen = mx.take_along_axis(candidates, mx.argmax(scores, axis=-1)[..., None], axis=-1)[..., 0]
    return chosen == labels


def simulated_cycles(leading: np.ndarray) -> list[int]:
    """Tokens emitted by each cycle of greedy speculative decoding over one sequence's generated part.

    ``leading[j]`` is the number of rows accepted by a cycle anchored at the j-th valid anchor
    (consecutive positions from the first generated token). Each cycle emits its accepted rows
    plus the bonus token and the next cycle is anchored at the last emitted token, as the engine
    does; the walk stops where no whole block fits.
    """
    cycles, j = [], 0
    while j < len(leading):
        cycles.append(int(leading[j]) + 1)
        j += cycles[-1]
    return cycles


def evaluate_drafter(
    target,
    drafter: Drafter,
    sequences: np.ndarray,
    continuation_start: int = 0,
    batch: int = 8,
) -> dict[str, float]:
    """Held-out metrics of a drafter on target-generated sequences (no training, no randomness).

    Every valid anchor of every sequence is scored (drafter forward only). Returns the mean
    metrics of ``drafter_loss`` over all those blocks (``tau`` = 1 + mean leading correct rows
    per anchor) and ``acceptance``: tokens per cycle of the greedy decoding that starts at the
    first generated token, simulated from the per-anchor results (what the engine reports on
    these continuations, up to the last partial block). ``acceptance`` is the number to quote:
    ``tau`` averages over anchors uniformly, while decoding spends more cycles where the drafter
    misses, so ``tau`` (and the training progress's) reads higher.
    """
    sequences = np.asarray(sequences, dtype=np.int32)
    cfg = drafter.config
    runner = target.runner
    lo, hi = anchor_range(sequences.shape[1], cfg.block_size, continuation_start)
    positions = np.arange(lo, hi + 1, dtype=np.int32)
    config = DrafterTrainingConfig(block_size=cfg.block_size, selector=False)
    weights = mx.array(loss_weights(cfg.block_size, config.resolved_gamma()))
    totals: dict[str, float] = {}
    count = tokens = cycles = 0
    for start in range(0, len(sequences), batch):
        seqs = sequences[start : start + batch]
        _, feats = runner(mx.array(seqs), runner.make_cache(), taps=cfg.target_layer_ids, logits_from=seqs.shape[1] - 1)
        anchors = np.tile(positions, (len(seqs), 1))
        blocks, labels, preds = block_arrays(seqs, anchors, cfg.block_size, cfg.mask_token_id)
        hidden = forward_blocks(drafter, runner.embed, feats, mx.array(blocks), mx.array(anchors))
        m = len(hidden)
        labels, preds = mx.array(labels.reshape(m, -1)), mx.array(preds.reshape(m, -1))
        _, metrics = drafter_loss(drafter, runner.lm_head, hidden, labels, preds, weights, config)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v.item()) * m
        count += m
        leading = np.array(_leading_run(greedy_walk_correct(drafter, runner.lm_head, hidden, labels, preds)))
        for row in leading.reshape(len(seqs), len(positions)):
            emitted = simulated_cycles(row)
            tokens, cycles = tokens + sum(emitted), cycles + len(emitted)
    out = {k: v / count for k, v in totals.items()}
    out.setdefault("tau", out["tau_top1"])
    out["acceptance"] = tokens / cycles
    out["cycles"] = cycles
    out["blocks"] = count
    return out


# ---------------------------------------------------------------------------------------------
# Features of the frozen target
# ---------------------------------------------------------------------------------------------


class _Features:
    """The target's tapped hidden states per sequence: precomputed when they fit, else per step."""

    def __init__(self, runner, sequences: np.ndarray, taps: list[int], budget: int, batch: int = 16, final: bool = False):
        self.runner, self.sequences, self.taps, self.final = runner, sequences, list(taps), final
        self.last = len(runner.layers) - 1
        n, s = sequences.shape
        nbytes = n * s * (len(taps) + int(final)) * runner.hidden_size * 4
        self.cached: Optional[tuple[mx.array, Optional[mx.array]]] = None
        if nbytes <= budget:
            parts = []
            for i in range(0, n, batch):
                parts.append(self._compute(sequences[i : i + batch]))
                mx.eval(parts[-1])
            self.cached = tuple(mx.concatenate(p, axis=0) if p[0] is not None else None for p in zip(*parts))
            mx.eval(self.cached)

    def _compute(self, tokens: np.ndarray) -> tuple[mx.array, Optional[mx.array]]:
        """(tapped features [n, S, T*H], the final-normed last hidden state [n, S, H] or None)."""
        taps = self.taps + ([self.last] if self.final else [])
        _, feats = self.runner(mx.array(tokens, dtype=mx.int32), self.runner.make_cache(), taps=taps, logits_from=tokens.shape[1] - 1)
        feats = mx.stop_gradient(feats.astype(mx.float32))
        if not self.final:
            return feats, None
        width = len(self.taps) * self.runner.hidden_size
        return feats[..., :width], self.runner.inner.norm(feats[..., width:])

    def __call__(self, indices: np.ndarray) -> tuple[mx.array, Optional[mx.array]]:
        """(features, final hidden or None) of the sequences ``indices``."""
        if self.cached is not None:
            idx = mx.array(indices)
            return tuple(c[idx] if c is not None else None for c in self.cached)
        return self._compute(self.sequences[indices])


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _data_fingerprint(sequences: np.ndarray, continuation_start: int) -> str:
    h = hashlib.sha256(np.ascontiguousarray(sequences, dtype=np.int32).tobytes())
    h.update(f"{sequences.shape}:{continuation_start}".encode())
    return h.hexdigest()


def _config_record(config: DrafterTrainingConfig) -> dict:
    return dataclasses.asdict(config)


def _save_checkpoint(out_dir: Path, drafter: Drafter, optimizer: optim.Optimizer, state: dict) -> None:
    """Weights + config in the real layout, optimiser state + bookkeeping in training_state/.

    Every file is written under a temporary name and renamed; the state JSON goes last and records
    the other files' hashes, so a checkpoint interrupted half-way is detected on resume.
    """
    sd = out_dir / STATE_DIR
    sd.mkdir(parents=True, exist_ok=True)
    tmp_model = sd / "model.partial.safetensors"
    tmp_opt = sd / "optimizer.partial.safetensors"
    # sorted names: the same state gives the same bytes, however the trees were built
    mx.save_safetensors(str(tmp_model), dict(sorted(tree_flatten(drafter.parameters()))))
    mx.save_safetensors(str(tmp_opt), dict(sorted((k, v) for k, v in tree_flatten(optimizer.state) if k not in ("step", "learning_rate"))))
    tmp_cfg = sd / "config.partial.json"
    tmp_cfg.write_text(json.dumps(drafter.config.to_dict(), indent=2))
    state = dict(state, model_sha256=_sha256(tmp_model), optimizer_sha256=_sha256(tmp_opt))
    tmp_state = sd / "state.partial.json"
    tmp_state.write_text(json.dumps(state, indent=2))
    os.replace(tmp_model, out_dir / "model.safetensors")
    os.replace(tmp_cfg, out_dir / "config.json")
    os.replace(tmp_opt, sd / "optimizer.safetensors")
    os.replace(tmp_state, sd / "state.json")


def load_checkpoint_state(out_dir: Path) -> Optional[dict]:
    """The bookkeeping of a run saved in ``out_dir`` (None when there is none)."""
    path = Path(out_dir) / STATE_DIR / "state.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} ({e}); the training state is damaged: delete {path.parent} to start afresh") from None


def _resume(out_dir: Path, state: dict, drafter: Drafter, optimizer: optim.Optimizer) -> None:
    sd = out_dir / STATE_DIR
    model_path, opt_path = out_dir / "model.safetensors", sd / "optimizer.safetensors"
    if not model_path.exists() or not opt_path.exists() or _sha256(model_path) != state.get("model_sha256") or _sha256(opt_path) != state.get("optimizer_sha256"):
        raise ValueError(
            f"the checkpoint in {out_dir} is incomplete (interrupted while saving); "
            f"delete {out_dir} (or use another output directory) to start afresh"
        )
    drafter.load_weights(list(mx.load(str(model_path)).items()))
    flat = mx.load(str(opt_path))
    opt_state = tree_unflatten(list(flat.items()))
    opt_state["step"] = mx.array(int(state["step"]), dtype=mx.uint64)
    opt_state["learning_rate"] = mx.array(0.0, dtype=mx.float32)
    optimizer.state = opt_state
    optimizer.init(drafter.trainable_parameters())  # keeps the loaded moments (only fills gaps)
    mx.eval(drafter.parameters(), optimizer.state)


# ---------------------------------------------------------------------------------------------
# Schedule and progress
# ---------------------------------------------------------------------------------------------


def learning_rate_at(config: DrafterTrainingConfig, fraction: float) -> float:
    """Linear warmup over ``warmup_fraction`` of the budget, then cosine to ``min_learning_rate_ratio``."""
    peak, floor = config.learning_rate, config.learning_rate * config.min_learning_rate_ratio
    fraction = min(max(fraction, 0.0), 1.0)
    warm = config.warmup_fraction
    if warm > 0 and fraction < warm:
        return peak * (fraction / warm)
    span = max(1.0 - warm, 1e-9)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * (fraction - warm) / span))


class _Bar:
    def __init__(self, total: float, unit: str, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            BarColumn(bar_width=12), TextColumn(f"{{task.completed:.0f}}/{{task.total:.0f}}{unit}"),
            TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.task = self.progress.add_task("train", total=total, stats="")
        self.progress.start()

    def update(self, completed: float, stats: str = "") -> None:
        if self.enabled:
            self.progress.update(self.task, completed=completed, stats=stats)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()


def _format(m: dict) -> str:
    """loss, drafter top-1 accuracy, selector accuracy, anchor-mean tau (reads higher than the
    real tokens per cycle: see ``evaluate_drafter``), sequence tokens per second."""
    parts = [f"loss {m['loss']:.3f}", f"acc {m['acc']:.2f}"]
    if "sel_acc" in m:
        parts.append(f"sel {m['sel_acc']:.2f}")
    parts += [f"τ~{m['tau']:.2f}", f"{m['tok_s']:.0f} tok/s"]
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


def train_drafter(
    target,
    sequences: np.ndarray,
    out_dir: Path,
    config: DrafterTrainingConfig,
    init: Optional[Path] = None,
    continuation_start: int = 0,
    progress: bool = True,
) -> Path:
    """Train a drafter on ``sequences`` (int32 [n, S], ideally from ``generate_training_sequences``).

    ``target`` is a ``loading.Target`` (frozen; its embedding and LM head are shared). Anchors are
    drawn at positions >= ``continuation_start`` with room for the block. Writes ``out_dir``
    (config.json + model.safetensors in the real layout, training_state/ for resume) and returns
    it; an ``out_dir`` holding a run's state resumes that run. Deterministic for a fixed seed and
    step budget; a ``minutes`` budget is not.
    """
    config.validate()
    out_dir = Path(out_dir)
    sequences = np.ascontiguousarray(np.asarray(sequences, dtype=np.int32))
    if sequences.ndim != 2 or sequences.shape[0] < 1:
        raise ValueError(f"sequences must be a non-empty [n, S] array of token ids, got shape {sequences.shape}")
    runner = target.runner
    n_seq, seq_len = sequences.shape
    anchor_range(seq_len, config.block_size, continuation_start)  # fail early with a clear message
    if runner.vocab_size and (sequences.min() < 0 or sequences.max() >= runner.vocab_size):
        raise ValueError(f"sequences hold token ids outside the target's vocabulary (size {runner.vocab_size})")
    fingerprint = _data_fingerprint(sequences, continuation_start)

    previous = load_checkpoint_state(out_dir)
    if previous is not None:
        old = previous.get("config", {})
        changed = sorted(k for k, v in _config_record(config).items() if k not in _RESUMABLE_CHANGES and old.get(k) != v)
        if changed:
            raise ValueError(
                f"{out_dir} holds a run with other settings ({', '.join(changed)}); resume it with the same "
                "settings or pick another output directory"
            )
        if previous.get("data_sha256") != fingerprint:
            raise ValueError(f"{out_dir} holds a run trained on other data; pick another output directory")
        drafter_config = DrafterConfig.from_dict(json.loads((out_dir / "config.json").read_text()))
        drafter = init_drafter(drafter_config, config)
    elif init is not None:
        drafter = _drafter_from_init(target, Path(init), config)
        drafter_config = drafter.config
    else:
        drafter_config = make_drafter_config(target, config)
        drafter = init_drafter(drafter_config, config)
    from dflash2_mlx.models.loading import validate_pair

    validate_pair(runner, drafter_config)
    _freeze_ablations(drafter, config)
    drafter.train()

    optimizer = optim.AdamW(learning_rate=config.learning_rate, betas=[0.9, 0.95], weight_decay=config.weight_decay, bias_correction=True)
    optimizer.init(drafter.trainable_parameters())
    step, elapsed, history = 0, 0.0, []
    if previous is not None:
        _resume(out_dir, previous, drafter, optimizer)
        step, elapsed, history = int(previous["step"]), float(previous.get("elapsed", 0.0)), list(previous.get("history", []))

    total_steps = config.total_steps
    budget = None if config.minutes is None else 60.0 * config.minutes
    stop_at = total_steps
    if config.stop_at_step is not None:
        stop_at = config.stop_at_step if stop_at is None else min(stop_at, config.stop_at_step)

    weights = mx.array(loss_weights(drafter_config.block_size, config.resolved_gamma()))
    soft = config.soft_target_weight > 0
    features = _Features(runner, sequences, drafter_config.target_layer_ids, config.feature_cache_bytes, final=soft)
    lm_head = runner.lm_head

    def loss_fn(feats, final, blocks, anchors, labels, preds):
        hidden = forward_blocks(drafter, runner.embed, feats, blocks, anchors)
        M = hidden.shape[0]
        target_logits = None if final is None else block_target_logits(lm_head, final, anchors, drafter_config.block_size)
        return drafter_loss(drafter, lm_head, hidden, labels.reshape(M, -1), preds.reshape(M, -1), weights, config,
                            target_logits)

    loss_and_grad = nn.value_and_grad(drafter, loss_fn)

    def train_step(feats, final, blocks, anchors, labels, preds):
        (loss, metrics), grads = loss_and_grad(feats, final, blocks, anchors, labels, preds)
        # The selector's gradients are clipped on their own: with the default (detached) selector
        # loss the drafter's trajectory is then exactly that of a run without the selector, so
        # the ablations "+ convs" and "+ both" share one drafter and differ only in the selector.
        selector_grads = grads.pop("candidate_selector", None)
        grads, norm = optim.clip_grad_norm(grads, config.grad_clip)
        metrics["grad_norm"] = norm
        if selector_grads is not None and tree_flatten(selector_grads):
            grads["candidate_selector"], metrics["selector_grad_norm"] = optim.clip_grad_norm(selector_grads, config.grad_clip)
        optimizer.update(drafter, grads)
        return metrics

    if config.compile:
        state = [drafter.state, optimizer.state]
        train_step = mx.compile(train_step, inputs=state, outputs=state)

    def record(step_now: int, complete: bool) -> dict:
        return {
            "step": step_now,
            "elapsed": elapsed,
            "complete": complete,
            "config": _config_record(config),
            "data_sha256": fingerprint,
            "num_sequences": n_seq,
            "sequence_length": seq_len,
            "continuation_start": int(continuation_start),
            "target": target.name,
            "architecture": drafter_config.architecture,
            "history": history,
            "environment": {
                "python": sys.version.split()[0],
                "mlx": getattr(mx, "__version__", "?"),
                "platform": platform.platform(),
                "machine": platform.machine(),
            },
        }

    def finished() -> bool:
        if stop_at is not None and step >= stop_at:
            return True
        return budget is not None and elapsed >= budget

    if finished():
        if previous is None:
            _save_checkpoint(out_dir, drafter, optimizer, record(step, True))
        return out_dir

    bar = _Bar(total_steps if total_steps is not None else budget, "" if total_steps is not None else "s", progress)
    window: dict[str, float] = {}
    window_steps, window_time = 0, 0.0
    seq_tokens = config.batch_size * seq_len
    try:
        while not finished():
            t0 = time.perf_counter()
            rng = _rng(config.seed, step)
            idx = batch_indices(n_seq, config.batch_size, config.seed, step)
            anchors = np.stack([
                sample_anchors(rng, seq_len, drafter_config.block_size, config.blocks_per_sequence, continuation_start)
                for _ in idx
            ])
            blocks, labels, preds = block_arrays(sequences[idx], anchors, drafter_config.block_size, drafter_config.mask_token_id)
            if total_steps is not None:
                fraction = step / total_steps
            else:
                fraction = elapsed / budget
            optimizer.learning_rate = learning_rate_at(config, fraction)
            metrics = train_step(
                *features(idx), mx.array(blocks), mx.array(anchors), mx.array(labels), mx.array(preds),
            )
            mx.eval(metrics, drafter.parameters(), optimizer.state)
            dt = time.perf_counter() - t0
            step += 1
            elapsed += dt
            window_steps += 1
            window_time += dt
            values = summarize({k: float(v.item()) for k, v in metrics.items()}, config)
            if not math.isfinite(values["loss"]):
                raise FloatingPointError(f"the loss is {values['loss']} at step {step}; lower the learning rate")
            for k, v in values.items():
                window[k] = window.get(k, 0.0) + v
            if window_steps >= config.log_every or finished():
                m = {k: v / window_steps for k, v in window.items()}
                m["tok_s"] = seq_tokens * window_steps / window_time
                m["block_tok_s"] = m["tok_s"] / seq_len * config.blocks_per_sequence * (drafter_config.block_size - 1)
                m["steps_s"] = window_steps / window_time
                m["lr"] = float(optimizer.learning_rate.item())
                history.append({"step": step, **{k: round(v, 5) for k, v in m.items()}})
                bar.update(step if total_steps is not None else min(elapsed, budget), f"step {step}  " + _format(m) if total_steps is None else _format(m))
                window, window_steps, window_time = {}, 0, 0.0
            if config.checkpoint_every and step % config.checkpoint_every == 0 and not finished():
                _save_checkpoint(out_dir, drafter, optimizer, record(step, False))
    except KeyboardInterrupt:
        _save_checkpoint(out_dir, drafter, optimizer, record(step, False))
        bar.close()
        raise
    bar.close()
    complete = (total_steps is not None and step >= total_steps) or (budget is not None and elapsed >= budget)
    _save_checkpoint(out_dir, drafter, optimizer, record(step, complete))
    return out_dir
