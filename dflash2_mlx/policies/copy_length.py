"""How many copied tokens a cycle verifies when the context offers a copy draft, and whether that
beats the drafter's block or a plain step.

A copy draft (``caches/token_index``: what followed an earlier occurrence of the last tokens)
costs no drafter pass, only the verify rows it adds, and it can be longer than the drafter's
block. Its worth is learnt like the drafter's: per-position conditional acceptance, kept per
agreement class (how many tokens before the end agreed with the earlier occurrence: the longer
the agreement, the likelier the text goes on the same way), for this request with forgetting and
for the loaded pair across requests. Its cost per verify size has a table of its own (no drafter
pass); a size it has not timed yet is priced from the block table's cost of that size, an upper
bound (that includes a draft), extrapolated linearly past the drafter's largest block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dflash2_mlx.policies.estimates import CostTable, PositionAcceptance, expected_tokens

# Verify rows a copy cycle may have: passes of up to 16 rows run compiled, one trace per row count,
# so a few sizes keep the traces few; past 16 the longer matches of an edited file pay on a Mac,
# where 32 rows cost about what one does.
COPY_SIZES = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
MAX_COPY = COPY_SIZES[-1] - 1  # copied tokens a cycle verifies at most
AGREEMENT_CLASSES = (3, 6, 12, 24)  # class i: agreement of at least this many tokens
# first-position acceptance assumed for a pair with no copy history: optimistic, then learnt
CLASS_PRIOR = (0.5, 0.7, 0.85, 0.9)
PRIOR_WEIGHT = 2.0  # the pair's copy history counts as at most this many cycles of the request's own
REQUEST_DECAY = 0.9  # per copy cycle of the class: a request moves from copying one region to another
PAIR_DECAY = 0.98


def agreement_class(agreement: int) -> int:
    """The class of a match that agreed on ``agreement`` tokens (0 for the shortest)."""
    return max([0] + [i for i, least in enumerate(AGREEMENT_CLASSES) if agreement >= least])


@dataclass
class CopyHistory:
    """What a loaded pair has measured of copy cycles: costs per mode, acceptance per
    (temperature, agreement class)."""

    costs: dict = field(default_factory=dict)  # "greedy" / "sampled" -> CostTable
    acceptance: dict = field(default_factory=dict)  # (temperature, class) -> PositionAcceptance

    def cost_table(self, greedy: bool) -> CostTable:
        return self.costs.setdefault("greedy" if greedy else "sampled", CostTable())

    def acceptance_for(self, temperature: float, klass: int) -> PositionAcceptance:
        return self.acceptance.setdefault((round(float(temperature), 2), klass), PositionAcceptance(MAX_COPY))


class CopyEstimates:
    """One request's view of copy drafts: its own acceptance per class, backed by the pair's."""

    def __init__(self, history: CopyHistory, block_costs: CostTable, max_block: int, greedy: bool, temperature: float):
        self.costs, self.block_costs, self.max_block = history.cost_table(greedy), block_costs, max_block
        classes = range(len(AGREEMENT_CLASSES))
        self.pair = [history.acceptance_for(0.0 if greedy else temperature, k) for k in classes]
        self.mine = [PositionAcceptance(MAX_COPY) for _ in classes]

    def rates(self, agreement: int) -> list[float]:
        k = agreement_class(agreement)
        return self.mine[k].rates(self.pair[k], PRIOR_WEIGHT, first=CLASS_PRIOR[k])

    def cost(self, rows: int, context_len: int) -> Optional[float]:
        """Seconds of a copy cycle of ``rows`` verify rows: timed, else the block table's price."""
        if self.costs.measured(rows, context_len):
            return self.costs.estimate(rows, context_len)
        own = self.costs.estimate(rows, context_len)  # another bucket's, or between timed sizes
        return own if own is not None else self._block_price(rows, context_len)

    def _block_price(self, rows: int, context_len: int) -> Optional[float]:
        if rows <= self.max_block:
            return self.block_costs.estimate(rows, context_len)
        top = self.block_costs.estimate(self.max_block, context_len)
        below = self.block_costs.estimate(self.max_block // 2, context_len)
        if top is None or below is None:
            return None
        per_row = max(0.0, (top - below) / (self.max_block - self.max_block // 2))
        return top + per_row * (rows - self.max_block)

    def best(self, agreement: int, available: int, context_len: int) -> tuple[int, float, float]:
        """(verify rows, expected tokens, seconds) of the copy size with the most tokens per
        second using at most ``available`` copied tokens; rows 0 when none can be priced."""
        rates = self.rates(agreement)
        best = (0, 0.0, float("inf"))
        for rows in COPY_SIZES:
            if rows - 1 > available:
                break
            cost = self.cost(rows, context_len)
            if cost is None or cost <= 0:
                continue
            e = expected_tokens(rates, rows)
            if e / cost > best[1] / best[2]:
                best = (rows, e, cost)
        return best

    def observe(self, rows: int, accepted: int, seconds: float, context_len: int, agreement: int) -> None:
        k = agreement_class(agreement)
        self.mine[k].observe(rows, accepted, REQUEST_DECAY)
        self.pair[k].observe(rows, accepted, PAIR_DECAY)
        self.costs.observe(rows, context_len, seconds)


def copy_size_at_most(drafts: int) -> int:
    """The largest copy cycle (in verify rows) that verifies at most ``drafts`` copied tokens."""
    return max([0] + [rows for rows in COPY_SIZES if rows - 1 <= drafts])
