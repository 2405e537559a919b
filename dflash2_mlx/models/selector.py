"""DFlash 2's candidate selector: a coherent path through each block row's top-k candidates.

Row i's candidates are the top-k tokens of the drafter's logits for that row (the "unary"
scores). Candidate b after predecessor a scores
``unary(b) + <predecessor_codebook[a] * hidden_projection(h_i), successor_codebook[b]>``;
the walk starts at the anchor token (the last token the target emitted).

With a draft vocabulary (``Drafter.set_draft_vocab``) the logits' columns are those token ids
only; the candidates are mapped back to token ids before the codebooks are read, so everything
after the top-k sees token ids as it does without one.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from dflash2_mlx.kernels import dispatch as kernels
from dflash2_mlx.kernels import reference


def top_k_candidates(logits: mx.array, k: int, vocab_ids: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
    """Top-k token ids and their logits per row, highest logit first. ``vocab_ids`` [V']: the
    token id of each column of ``logits`` (None: column i is token i).

    Sorting the k survivors fixes the order the greedy walk breaks ties in (the first maximum,
    so among equal scores the higher unary logit wins); q is compared as a token -> probability
    map anyway, so the order never changes what is proposed with what probability.
    """
    candidates = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
    unary = mx.take_along_axis(logits, candidates, axis=-1)
    order = mx.argsort(-unary, axis=-1)
    candidates = mx.take_along_axis(candidates, order, axis=-1).astype(mx.int32)
    unary = mx.take_along_axis(unary, order, axis=-1)
    if vocab_ids is not None:
        candidates = vocab_ids[candidates]
    return candidates, unary


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        # Plain arrays, not nn.Embedding: the checkpoint stores them without a `.weight` suffix.
        self.predecessor_codebook = mx.zeros((vocab_size, rank))
        self.successor_codebook = mx.zeros((vocab_size, rank))
        self._vocab_ids: Optional[mx.array] = None  # the draft vocabulary (not a parameter)

    def set_vocab_ids(self, vocab_ids: Optional[mx.array]) -> None:
        """The token id of each column of the logits the selector is given (None: all of them)."""
        self._vocab_ids = vocab_ids

    def greedy(self, hidden: mx.array, logits: mx.array, anchor: mx.array) -> mx.array:
        """hidden [N, R, H], logits [N, R, V], anchor [N] -> draft tokens [N, R]."""
        candidates, unary = top_k_candidates(logits, self.top_k, self._vocab_ids)
        return kernels.select_greedy(
            anchor,
            candidates,
            unary,
            self.hidden_projection(hidden),
            self.predecessor_codebook,
            self.successor_codebook,
        )

    def pair_scores(self, hidden: mx.array, logits: mx.array, anchor: mx.array) -> tuple[mx.array, mx.array]:
        """hidden [N, R, H], logits [N, R, V], anchor [N] -> (candidates [N, R, k], pair scores
        [N, R, k, k]) for a walk done elsewhere (the grammar's, which skips refused candidates)."""
        candidates, unary = top_k_candidates(logits, self.top_k, self._vocab_ids)
        return candidates, reference.pair_scores(
            anchor,
            candidates,
            unary,
            self.hidden_projection(hidden),
            self.predecessor_codebook,
            self.successor_codebook,
        )
