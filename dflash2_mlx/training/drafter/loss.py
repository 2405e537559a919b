"""The drafter's training forward and loss.

Blocks are run through ``Drafter.train_forward`` on the frozen target's features; the loss is
the row-weighted cross-entropy (optionally partly against the target's own distribution) plus,
for DFlash 2, the selector's cross-entropy over each row's top-k candidates given the true
predecessor. The metrics include the acceptance a greedy cycle would get on these blocks.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.selector import top_k_candidates
from dflash2_mlx.training.drafter.config import DrafterTrainingConfig

__all__ = [
    "block_target_logits",
    "drafter_head",
    "drafter_loss",
    "forward_blocks",
    "leading_run",
    "selector_scores",
    "summarize",
]


def drafter_head(runner, drafter: Drafter) -> tuple[Callable[[mx.array], mx.array], Optional[np.ndarray]]:
    """The head the drafter scores with, and with a draft vocabulary the map token id -> column
    of its logits (-1 outside it), for labels; None: every token id is its own column."""
    vocab = drafter.draft_vocab
    if vocab is None:
        return runner.lm_head, None
    column_of = np.full(runner.vocab_size, -1, dtype=np.int32)
    column_of[np.array(vocab)] = np.arange(vocab.shape[0], dtype=np.int32)
    return runner.head_rows(vocab), column_of


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


def selector_scores(
    selector, hidden: mx.array, candidates: mx.array, unary: mx.array, predecessors: mx.array
) -> mx.array:
    """Teacher-forced pair scores [M, R, k]: row i's candidates after the true token of row i-1."""
    left = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)  # [M, R, r]
    right = selector.successor_codebook[candidates]  # [M, R, k, r]
    return unary + (right @ left[..., None])[..., 0]


def leading_run(correct: mx.array) -> mx.array:
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
    valid: Optional[mx.array] = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """(total loss, metrics) from the block hidden rows [M, B, H] (row 0 = anchor, not scored).

    ``target_logits`` [M, B-1, V]: the frozen target's logits for the rows' positions; with
    ``config.soft_target_weight`` > 0 that share of each row's cross-entropy is taken against
    the target's softmax instead of the label (metric ``soft``: that soft cross-entropy).

    With a draft vocabulary (``drafter.draft_vocab``, V' ids) ``lm_head`` scores those ids only,
    ``target_logits`` hold the same columns (the teacher is the target's distribution given the
    vocabulary: what the drafter can propose) and ``labels`` are column indices, -1 for a token
    outside it (no cross-entropy, never right: such a token can never be drafted).

    ``valid`` [M, B-1] (bool): the rows to train on; a row whose label lies after its answer's
    end token (``batches.label_mask``) counts in no loss and is never right. None: all.

    metrics: ce, sel (selector loss), acc (drafter top-1), sel_acc (selector top-1 with the true
    predecessor), hit (label within the top-k: the rows the selector loss counts), tau / tau_top1
    (1 + leading correct rows: the acceptance length a greedy cycle would get on these blocks,
    with / without the selector). Every metric is a distinct array and the total is not among
    them (mx.compile of a gradient fails on duplicated outputs; ``summarize`` adds both back).
    """
    h = hidden[:, 1:]
    logits = drafter.logits(h, lm_head)  # [M, R, V]
    if valid is not None:
        weights = weights * valid.astype(mx.float32)  # [M, R]
    inside = labels >= 0  # [M, R] the label is a column (always, without a draft vocabulary)
    ce = nn.losses.cross_entropy(logits, mx.maximum(labels, 0), reduction="none") * inside  # [M, R]
    soft = None
    if target_logits is not None and config.soft_target_weight > 0:
        teacher = mx.softmax(mx.stop_gradient(target_logits).astype(mx.float32), axis=-1)
        soft = -(teacher * nn.log_softmax(logits, axis=-1)).sum(axis=-1)  # [M, R]
        ce = (1.0 - config.soft_target_weight) * ce + config.soft_target_weight * soft
    ce_loss = (ce * weights).sum(axis=-1).mean()
    top1 = mx.argmax(logits, axis=-1) == labels
    if valid is None:
        acc = top1.astype(mx.float32).mean()
    else:
        top1 = top1 & valid
        acc = top1.astype(mx.float32).sum() / mx.maximum(valid.astype(mx.float32).sum(), 1.0)
    metrics = {"ce": ce_loss, "acc": acc, "tau_top1": 1.0 + leading_run(top1).mean()}
    if soft is not None:
        metrics["soft"] = (soft * weights).sum(axis=-1).mean()
    total = ce_loss
    if drafter.config.is_dflash2:
        sel = drafter.candidate_selector
        detached = mx.stop_gradient(logits)
        candidates, unary = top_k_candidates(detached, sel.top_k)  # columns of logits
        if config.selector_grad_to_drafter:
            unary = mx.take_along_axis(logits, candidates, axis=-1)
            sel_hidden = h
        else:
            sel_hidden = mx.stop_gradient(h)
        vocab = drafter.draft_vocab  # the codebooks are indexed by token id
        candidate_ids = candidates if vocab is None else vocab[candidates]
        scores = selector_scores(sel, sel_hidden, candidate_ids, unary, predecessors)
        hit = candidates == labels[..., None]
        found = hit.any(axis=-1)
        if valid is not None:
            found = found & valid
        index = mx.argmax(hit.astype(mx.int32), axis=-1)
        chosen = mx.argmax(scores, axis=-1)
        right = found & (chosen == index)
        metrics.update(
            sel_acc=right.astype(mx.float32).mean(),
            hit=found.astype(mx.float32).mean(),
            tau=1.0 + leading_run(right).mean(),
        )
        if config.selector:
            sce = nn.losses.cross_entropy(scores, index, reduction="none")
            w = weights * found.astype(mx.float32)
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
