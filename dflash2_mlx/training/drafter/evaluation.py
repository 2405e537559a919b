"""Held-out evaluation of a drafter: the acceptance greedy speculative decoding would reach.

Every valid anchor of target-generated sequences is scored with the drafter alone (no training,
no randomness); the per-anchor accepted counts are replayed as the engine's cycles would consume
them, which gives the tokens per cycle to quote.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.selector import top_k_candidates
from dflash2_mlx.training.drafter.batches import anchor_range, block_arrays, loss_weights, per_sequence
from dflash2_mlx.training.drafter.config import DrafterTrainingConfig
from dflash2_mlx.training.drafter.loss import drafter_head, drafter_loss, forward_blocks, leading_run, selector_scores

__all__ = [
    "evaluate_drafter",
    "greedy_walk_correct",
    "simulated_cycles",
]


def greedy_walk_correct(
    drafter: Drafter, lm_head, hidden: mx.array, labels: mx.array, predecessors: mx.array
) -> mx.array:
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
    candidates, unary = top_k_candidates(logits, sel.top_k, drafter.draft_vocab)  # token ids
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
    continuation_start=0,
    batch: int = 8,
    ends: Optional[Sequence[int]] = None,
    features=None,
) -> dict[str, float]:
    """Held-out metrics of a drafter on target-generated sequences (no training, no randomness).

    Every valid anchor of every sequence is scored (drafter forward only). Returns the mean
    metrics of ``drafter_loss`` over all those blocks (``tau`` = 1 + mean leading correct rows
    per anchor) and ``acceptance``: tokens per cycle of the greedy decoding that starts at the
    first generated token, simulated from the per-anchor results (what the engine reports on
    these continuations, up to the last partial block; with ``ends``, each sequence's answer-end
    position (``answer_ends``), up to the cycle that emits the end token, where decoding
    stops: the text a model writes after ending its turn is never drafted). ``acceptance`` is the number to quote:
    ``tau`` averages over anchors uniformly, while decoding spends more cycles where the drafter
    misses, so ``tau`` (and the training progress's) reads higher.

    ``continuation_start``: an int, or one per sequence (where its answer begins). ``features``:
    the target's taps of ``sequences`` computed before (a ``TargetFeatures``, e.g. from the
    whole prompt when a row holds only its tail); None computes them from the rows themselves.
    """
    sequences = np.asarray(sequences, dtype=np.int32)
    cfg = drafter.config
    runner = target.runner
    starts = per_sequence(continuation_start, len(sequences), "continuation_start")
    lo, hi = anchor_range(sequences.shape[1], cfg.block_size, int(starts.min()))
    anchor_range(sequences.shape[1], cfg.block_size, int(starts.max()))
    positions = np.arange(lo, hi + 1, dtype=np.int32)
    config = DrafterTrainingConfig(block_size=cfg.block_size, selector=False)
    weights = mx.array(loss_weights(cfg.block_size, config.resolved_gamma()))
    totals: dict[str, float] = {}
    count = tokens = cycles = 0
    head, column_of = drafter_head(runner, drafter)
    for start in range(0, len(sequences), batch):
        seqs = sequences[start : start + batch]
        if features is not None:
            feats = features(np.arange(start, start + len(seqs)))[0]
        else:
            _, feats = runner(
                mx.array(seqs), runner.make_cache(), taps=cfg.target_layer_ids, logits_from=seqs.shape[1] - 1
            )
        anchors = np.tile(positions, (len(seqs), 1))
        blocks, labels, preds = block_arrays(seqs, anchors, cfg.block_size, cfg.mask_token_id)
        hidden = forward_blocks(drafter, runner.embed, feats, mx.array(blocks), mx.array(anchors))
        # the blocks anchored inside each answer (all of them when every answer starts at lo)
        scored = (anchors >= starts[start : start + len(seqs), None]).reshape(-1)
        kept = mx.array(np.flatnonzero(scored))
        m = int(scored.sum())
        columns = (labels if column_of is None else column_of[labels]).reshape(-1, cfg.block_size - 1)[scored]
        labels = mx.array(labels.reshape(-1, cfg.block_size - 1))
        preds = mx.array(preds.reshape(-1, cfg.block_size - 1))
        _, metrics = drafter_loss(drafter, head, hidden[kept], mx.array(columns), preds[kept], weights, config)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v.item()) * m
        count += m
        leading = np.array(leading_run(greedy_walk_correct(drafter, head, hidden, labels, preds)))
        for i, row in enumerate(leading.reshape(len(seqs), len(positions))):
            first = int(starts[start + i]) - lo  # the anchor of the answer's first token
            row, own = row[first:], positions[first:]
            if ends is not None:  # anchors before the end token; no cycle emits past it
                end = int(ends[start + i])
                kept_anchors = max(end - int(own[0]), 0)
                row = np.minimum(row[:kept_anchors], end - own[:kept_anchors] - 1)
            emitted = simulated_cycles(row)
            tokens, cycles = tokens + sum(emitted), cycles + len(emitted)
    out = {k: v / count for k, v in totals.items()}
    out.setdefault("tau", out["tau_top1"])
    out["acceptance"] = tokens / cycles
    out["cycles"] = cycles
    out["blocks"] = count
    return out
