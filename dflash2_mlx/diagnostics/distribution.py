"""Checking that sampled output follows the target's distribution: the exact probabilities of the
first generated tokens, and a G-test of draws against them.

``exact_joint`` walks the tree of continuations of a prompt through the target's processed
distributions (the caller's function gives the next-token probabilities after a continuation), so
the probability of every sequence of the first ``depth`` tokens is known exactly; prefixes below a
mass are not expanded and their mass stays in the remainder (``Joint.rest``). ``g_test`` compares
counts of draws with those probabilities. The tests (``tests/test_sampling.py``) and the SmolLM2
check (``benchmarks/smollm2_distribution.py``) share them. Needs scipy (the ``test`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["ALPHA", "GTest", "Joint", "exact_joint", "g_test", "g_test_pvalue"]

# The false-alarm rate the statistical tests and checks use: a correct sampler fails a given set
# of seeds with probability ALPHA.
ALPHA = 1e-3

# (tokens generated so far) -> next-token probabilities [V] (numpy, zero where never drawn)
NextProbs = Callable[[tuple], np.ndarray]


@dataclass(frozen=True)
class GTest:
    statistic: float
    df: int
    pvalue: float
    cells: int  # after pooling the cells expected below 5


def g_test(counts: np.ndarray, expected_p: np.ndarray) -> GTest:
    """G-test of counts against expected probabilities, pooling cells expected below 5."""
    from scipy.stats import chi2

    counts = np.asarray(counts, dtype=float)
    expected_p = np.asarray(expected_p, dtype=float)
    n = counts.sum()
    expected = expected_p * n
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    nz = counts > 0
    # a pooled bucket with zero expected mass would have g = inf: impossible outcomes seen
    with np.errstate(divide="ignore"):
        g = 2.0 * np.sum(counts[nz] * np.log(counts[nz] / expected[nz]))
    df = max(len(counts) - 1, 1)
    return GTest(float(g), df, float(chi2.sf(g, df=df)), len(counts))


def g_test_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """The p-value of ``g_test``."""
    return g_test(counts, expected_p).pvalue


@dataclass
class Joint:
    """The exact probabilities of the first ``depth`` tokens: ``cells`` (sequence -> probability)
    for every sequence under an expanded prefix, ``rest`` the mass of the prefixes left unexpanded."""

    depth: int
    cells: dict
    rest: float
    expanded: int  # prefixes whose next-token distribution was computed

    def expected(self) -> tuple[list[tuple], np.ndarray]:
        """The cells in a fixed order and their probabilities, the remainder last."""
        keys = sorted(self.cells)
        return keys, np.array([self.cells[k] for k in keys] + [max(self.rest, 0.0)])

    def counts(self, draws: Sequence[Sequence[int]]) -> np.ndarray:
        """Counts of ``draws`` (their first ``depth`` tokens) in the cells of ``expected``, the
        remainder last (a draw under an unexpanded prefix, or one the walk gave probability 0)."""
        keys, _ = self.expected()
        index = {k: i for i, k in enumerate(keys)}
        out = np.zeros(len(keys) + 1)
        for d in draws:
            out[index.get(tuple(d[: self.depth]), len(keys))] += 1
        return out


def exact_joint(next_probs: NextProbs, depth: int, min_mass: float = 0.0) -> Joint:
    """The exact joint of the first ``depth`` tokens. A prefix is expanded (``next_probs`` called)
    when its probability is at least ``min_mass``; with ``min_mass`` 5 / draws, nothing left
    unexpanded could have made a cell the G-test keeps apart from the pooled small ones."""
    cells: dict = {}
    rest = 0.0
    expanded = 0
    frontier = [((), 1.0)]
    while frontier:
        prefix, mass = frontier.pop()
        if mass < min_mass:
            rest += mass
            continue
        p = np.asarray(next_probs(prefix), dtype=float)
        expanded += 1
        for t in np.flatnonzero(p > 0):
            seq, m = prefix + (int(t),), mass * float(p[t])
            if len(seq) == depth:
                cells[seq] = m
            else:
                frontier.append((seq, m))
    return Joint(depth, cells, rest, expanded)
