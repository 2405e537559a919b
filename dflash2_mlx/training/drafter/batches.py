"""The data of one training step, all randomness derived from (seed, step).

Which sequences a step reads (epochs of seeded permutations), where its anchors lie (inside the
target-generated part, with room for the block), the row weights of the loss, and the block,
label and predecessor arrays built from those anchors. Deterministic, so a resumed run draws
exactly what an uninterrupted one would.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = [
    "anchor_range",
    "answer_ends",
    "batch_indices",
    "block_arrays",
    "label_mask",
    "loss_weights",
    "per_sequence",
    "sample_anchors",
    "step_rng",
]


def step_rng(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(step), int(stream)])


def batch_indices(num_sequences: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Sequence indices of one step: epochs of seeded permutations, read in order."""
    positions = step * batch_size + np.arange(batch_size)
    epochs, offsets = positions // num_sequences, positions % num_sequences
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        perm = step_rng(seed, int(epoch), 1).permutation(num_sequences)
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


def per_sequence(value, n: int, name: str) -> np.ndarray:
    """int64 [n]: one value per sequence (an int is every sequence's)."""
    out = np.asarray(value)
    if out.ndim == 0:
        out = np.full(n, out)
    if out.shape != (n,) or not np.issubdtype(out.dtype, np.integer):
        raise ValueError(f"{name} is an int or one int per sequence ({n}), got shape {np.shape(value)}")
    return out.astype(np.int64)


def answer_ends(sequences: np.ndarray, continuation_start, end_token_ids) -> np.ndarray:
    """[n] position of each sequence's first end token at or after its ``continuation_start``
    (an int, or one per sequence; its length when there is none, or no end tokens are given)."""
    n, seq_len = sequences.shape
    starts = per_sequence(continuation_start, n, "continuation_start")
    ends = np.full(n, seq_len, dtype=np.int64)
    if len(end_token_ids):
        is_end = np.isin(sequences, np.asarray(end_token_ids)) & (np.arange(seq_len)[None] >= starts[:, None])
        found = is_end.any(axis=1)
        ends[found] = is_end.argmax(axis=1)[found]
    return ends


def label_mask(anchors: np.ndarray, block_size: int, valid_lengths: np.ndarray) -> np.ndarray:
    """bool [n, N, B-1]: the rows whose label (position a + i, i = 1..B-1) lies before its
    sequence's ``valid_lengths`` [n]: the tokens the target wrote up to its end token. Rows after
    it are not trained on: the engine stops at the end token and never drafts past it."""
    positions = anchors[..., None] + np.arange(1, block_size)
    return positions < np.asarray(valid_lengths)[:, None, None]


def sample_anchors(
    rng: np.random.Generator,
    seq_len: int,
    block_size: int,
    count: int,
    continuation_start: int,
    answer_end: Optional[int] = None,
) -> np.ndarray:
    """``count`` sorted anchor positions for one sequence (distinct when there are enough). With
    ``answer_end`` (the position of the answer's end token) no anchor lies at or after it, so the
    block's first row at the latest predicts the end token itself."""
    lo, hi = anchor_range(seq_len, block_size, continuation_start)
    if answer_end is not None:
        hi = max(lo, min(hi, int(answer_end) - 1))
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
