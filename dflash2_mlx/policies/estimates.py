"""The estimates a block policy decides with: cycle costs per block size and context bucket, and
per-position acceptance counts, with what a block of b is expected to emit.

Shared by the break-even controller (``block_size``) and the copy drafts' lengths
(``copy_length``): both price a cycle from the same kind of measurements.
"""

from __future__ import annotations

from typing import Optional, Sequence

PRIOR_RATE = 0.9  # conditional acceptance assumed for a pair with no history yet: speculate first, then learn
SMOOTHING = 1.0  # cycles' worth of pull of each position's rate towards the previous position's
COST_DECAY = 0.8  # per timed cycle of that size and bucket
SPEED_SHARE = 0.5  # how much of a size's cost change the other sizes of its bucket follow
OUTLIER = 3.0  # a cycle timed above this many times its estimate (a page fault, a GC) counts as this


def bucket(context_len: int) -> int:
    """Context-length bucket: 0 below 512 tokens, then one per doubling (attention cost grows)."""
    return max(0, int(context_len).bit_length() - 9)


class CostTable:
    """Seconds per cycle of each block size per context bucket (exponentially weighted)."""

    def __init__(self):
        self.seconds: dict[int, dict[int, float]] = {}  # bucket -> block size -> seconds

    def observe(self, block_size: int, context_len: int, seconds: float) -> None:
        row = self.seconds.setdefault(bucket(context_len), {})
        old = row.get(block_size)
        if old is None:
            row[block_size] = seconds
            return
        row[block_size] = COST_DECAY * old + (1 - COST_DECAY) * min(seconds, OUTLIER * old)
        # the machine got slower or faster (a shared machine, thermal limits): so did every size,
        # partly, or a size timed long ago would look cheap or dear forever
        drift = (row[block_size] / old) ** SPEED_SHARE
        for b in row:
            if b != block_size:
                row[b] *= drift

    def measured(self, block_size: int, context_len: int) -> bool:
        return block_size in self.seconds.get(bucket(context_len), {})

    def estimate(self, block_size: int, context_len: int) -> Optional[float]:
        """The cost at this bucket; unmeasured there, the nearest bucket's scaled by a size both
        measured; sizes never measured anywhere are interpolated between measured ones."""
        k = bucket(context_len)
        here = self.seconds.get(k, {})
        if block_size in here:
            return here[block_size]
        for other in sorted(self.seconds, key=lambda b: (abs(b - k), -b)):
            row = self.seconds[other]
            if block_size not in row:
                continue
            common = [s for s in here if s in row]
            scale = here[common[-1]] / row[common[-1]] if common else 1.0
            return row[block_size] * scale
        return self._interpolated(block_size, context_len)

    def _interpolated(self, block_size: int, context_len: int) -> Optional[float]:
        sizes = sorted({s for row in self.seconds.values() for s in row})
        lower = [s for s in sizes if s < block_size]
        upper = [s for s in sizes if s > block_size]
        if not lower or not upper:
            return None
        lo, hi = lower[-1], upper[0]
        a, b = self.estimate(lo, context_len), self.estimate(hi, context_len)
        return a + (b - a) * (block_size - lo) / (hi - lo)

    @property
    def calibrated(self) -> bool:
        return bool(self.seconds)

    def start_from(self, other: "CostTable") -> None:
        """Take ``other``'s costs as this table's first estimate (its own timed cycles refine them):
        a server seeds the sampled table from the greedy calibration instead of calibrating twice."""
        self.seconds = {k: dict(row) for k, row in other.seconds.items()}


class PositionAcceptance:
    """Per draft position j: exponentially weighted counts of cycles that tested it (drafts
    1..j-1 accepted, a draft at j) and that accepted it."""

    def __init__(self, positions: int):
        self.tested = [0.0] * positions
        self.accepted = [0.0] * positions

    def observe(self, block_size: int, accepted: int, decay: float) -> None:
        for j in range(len(self.tested)):
            self.tested[j] *= decay
            self.accepted[j] *= decay
        for j in range(min(accepted + 1, block_size - 1)):  # positions 0..accepted were tested
            self.tested[j] += 1.0
            self.accepted[j] += float(j < accepted)

    def rates(
        self, prior: Optional["PositionAcceptance"] = None, prior_weight: float = 0.0, first: float = PRIOR_RATE
    ) -> list[float]:
        """Conditional acceptance per position. ``prior``'s counts join this one's, scaled to at
        most ``prior_weight`` cycles per position; each position is then shrunk towards the one
        before it by ``SMOOTHING`` cycles, so a position not tested lately (the blocks got shorter)
        follows the ones that were instead of keeping a stale rate. The first position is shrunk
        towards ``prior``'s own rate there, or ``PRIOR_RATE`` for a pair with no history yet: the
        optimistic prior (``first``) is for a new pair, and kept for a known one it held a request on text the
        drafter cannot predict at a rate twice its true one (0.2 for 0.1), speculating at a loss."""
        out, last = [], first
        if prior is not None and prior.tested[0] > 1e-3:
            last = prior.accepted[0] / prior.tested[0]
        for j, (t, a) in enumerate(zip(self.tested, self.accepted)):
            if prior is not None and prior.tested[j] > 1e-3:
                scale = min(1.0, prior_weight / prior.tested[j])
                t, a = t + scale * prior.tested[j], a + scale * prior.accepted[j]
            last = (a + SMOOTHING * last) / (t + SMOOTHING)
            out.append(last)
        return out

    @property
    def tested_any(self) -> bool:
        return any(t > 1e-3 for t in self.tested)


def expected_tokens(rates: Sequence[float], block_size: int) -> float:
    """E(b) = 1 + sum over i < b of the product of the first i conditional acceptance rates."""
    total, run = 1.0, 1.0
    for c in rates[: block_size - 1]:
        run *= c
        total += run
    return total


def monotone(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): a bigger block does more
    work than a smaller one, so a noisy timing that says otherwise is averaged with its neighbours."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]
