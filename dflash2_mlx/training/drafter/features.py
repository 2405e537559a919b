"""The frozen target's tapped hidden states that the drafter trains on.

Computed once for all sequences when they fit the byte budget, else per step; optionally with
the target's final-normed last hidden state too (for soft targets).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

__all__ = [
    "TargetFeatures",
]


class TargetFeatures:
    """The target's tapped hidden states per sequence: precomputed when they fit, else per step."""

    def __init__(
        self, runner, sequences: np.ndarray, taps: list[int], budget: int, batch: int = 16, final: bool = False
    ):
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

    @classmethod
    def from_arrays(
        cls, runner, sequences: np.ndarray, taps: list[int], features: mx.array, final: Optional[mx.array] = None
    ) -> "TargetFeatures":
        """Features computed before (and kept on disk), for ``sequences``: [n, S, len(taps) * H]
        and, for soft targets, the final-normed last hidden state [n, S, H]."""
        n, s = sequences.shape
        if features.shape != (n, s, len(taps) * runner.hidden_size):
            raise ValueError(
                f"features of shape {features.shape} do not match {n} sequences of {s} tokens "
                f"and {len(taps)} taps of width {runner.hidden_size}"
            )
        self = cls.__new__(cls)
        self.runner, self.sequences, self.taps, self.final = runner, sequences, list(taps), final is not None
        self.last = len(runner.layers) - 1
        self.cached = (features, final)
        return self

    def _compute(self, tokens: np.ndarray) -> tuple[mx.array, Optional[mx.array]]:
        """(tapped features [n, S, T*H], the final-normed last hidden state [n, S, H] or None)."""
        taps = self.taps + ([self.last] if self.final else [])
        _, feats = self.runner(
            mx.array(tokens, dtype=mx.int32), self.runner.make_cache(), taps=taps, logits_from=tokens.shape[1] - 1
        )
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
