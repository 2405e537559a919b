"""Which block size pays: the break-even controller of the speculative loop.

Before each cycle the decode loop asks its policy ``choose(context_len)`` for a block size: 1 is
a plain step (the target runs the anchor alone, no draft), 2..B a speculative cycle. After the
cycle's host sync it reports ``observe(block_size, accepted, seconds, context_len)``. Every choice
is lossless (each cycle emits the target's own continuation, or a draw from its exact
distribution, whatever its size), so a policy only trades speed.

``BreakEvenController`` picks the size with the most expected tokens per second:

- A block of size b emits E(b) = 1 + sum over i < b of P(drafts 1..i all accepted). P is the
  product of per-position conditional acceptance rates c_j = P(draft j accepted | 1..j-1 were),
  counted in this request with exponential forgetting and shrunk towards the pair's recent
  history (shared by every request of the same loaded pair and temperature); each position is
  also pulled towards the one before it, so one not tested lately follows those that were.
- Costs are seconds per cycle of each size (1 = a plain step) per context-length bucket, timed by
  the loop itself: a short calibration run at the pair's first use times real cycles of every
  size, and every later cycle of the same kind as the one before it (a block after a block, a
  plain step after a plain step) refines its own entry. A cycle is timed within one resumption of
  the generator (from after the ``yield`` to the end of its bookkeeping), never across a yield, so
  time the consumer spends elsewhere (other requests of a scheduler, printing) never counts.
  The first block after plain steps is not a block's steady cost: its drafter first takes in the
  plain steps' rows, and it could not be drafted ahead (SmolLM2: 1.35 plain steps against 1.1).
  Timed into the table, such probes priced block 2 out of a request once it went plain.
- When no block beats a plain step, it decodes plainly and probes with an occasional speculative
  cycle, so that it notices when acceptance recovers; symmetrically, while speculating it re-times
  a plain step with a few plain steps every ``PLAIN_REFRESH`` cycles (a plain step's cost is
  otherwise only the calibration's, which a noisy machine can get wrong). Probes are paid from a budget: a probe is
  allowed only while the time all probes cost beyond the plain steps they replace (measured, in
  the worst case that nothing is accepted) stays under ``PROBE_BUDGET`` of this request's decode
  time so far, including the probe's own predicted excess (the larger of its cost table's
  excess and the mean measured excess of this request's probes so far), and only one probe is in
  flight at a time. The bound can be exceeded only by the misprediction of a single probe, which
  then delays the next one.
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

PLAIN = 1
PROBE_BUDGET = 0.01  # of decode time; the documented bound (3%) leaves room for mispredicted probes
PRIOR_RATE = 0.9  # conditional acceptance assumed for a pair with no history yet: speculate first, then learn
PRIOR_WEIGHT = 2.0  # the pair's history counts as at most this many cycles of the request's own
SMOOTHING = 1.0  # cycles' worth of pull of each position's rate towards the previous position's
REQUEST_DECAY = 0.93  # per cycle: a request's acceptance follows its text (code, prose, a tool call)
PAIR_DECAY = 0.98  # per cycle: the pair's history spans a few requests
COST_DECAY = 0.8  # per timed cycle of that size and bucket
PLAIN_REFRESH = 48  # speculative cycles after which a few plain steps re-time a plain step (symmetric to probes)
PLAIN_RUN = 3  # plain steps per refresh: the later ones are timed in their steady state
SPEED_SHARE = 0.5  # how much of a size's cost change the other sizes of its bucket follow
OUTLIER = 3.0  # a cycle timed above this many times its estimate (a page fault, a GC) counts as this


class BlockPolicy(Protocol):
    """What the decode loop asks before and tells after each cycle."""

    def choose(self, context_len: int) -> int:
        """Block size of the next cycle: 1 (a plain step) or 2..B."""

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int) -> None:
        """A cycle of ``block_size`` accepted ``accepted`` drafts and took ``seconds``."""

    def summary(self) -> dict:
        """What the policy did (``generate --json``'s ``controller`` object)."""


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

    def rates(self, prior: Optional["PositionAcceptance"] = None, prior_weight: float = 0.0) -> list[float]:
        """Conditional acceptance per position. ``prior``'s counts join this one's, scaled to at
        most ``prior_weight`` cycles per position; each position is then shrunk towards the one
        before it by ``SMOOTHING`` cycles, so a position not tested lately (the blocks got shorter)
        follows the ones that were instead of keeping a stale rate. The first position is shrunk
        towards ``prior``'s own rate there, or ``PRIOR_RATE`` for a pair with no history yet: the
        optimistic prior is for a new pair, and kept for a known one it held a request on text the
        drafter cannot predict at a rate twice its true one (0.2 for 0.1), speculating at a loss."""
        out, last = [], PRIOR_RATE
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


@dataclass
class PairProfile:
    """What a loaded (target, drafter) pair has measured: costs per mode, acceptance per temperature."""

    positions: int
    costs: dict = field(default_factory=dict)  # "greedy" / "sampled" -> CostTable
    history: dict = field(default_factory=dict)  # temperature -> PositionAcceptance

    def cost_table(self, greedy: bool) -> CostTable:
        return self.costs.setdefault("greedy" if greedy else "sampled", CostTable())

    def acceptance(self, temperature: float) -> PositionAcceptance:
        return self.history.setdefault(round(float(temperature), 2), PositionAcceptance(self.positions))


# (id(target model), id(drafter)) -> (weak refs to both, profile): nn.Modules are dicts, so not
# hashable; the weak refs tell a live pair from a dead one whose ids were reused
_PROFILES: dict = {}


def profile_for(model, drafter) -> PairProfile:
    """The pair's shared profile, for as long as both models live."""
    key = (id(model), id(drafter))
    entry = _PROFILES.get(key)
    if entry is None or entry[0]() is not model or entry[1]() is not drafter:
        for k in [k for k, (m, d, _) in _PROFILES.items() if m() is None or d() is None]:
            del _PROFILES[k]
        entry = (weakref.ref(model), weakref.ref(drafter), PairProfile(drafter.config.block_size - 1))
        _PROFILES[key] = entry
    return entry[2]


def expected_tokens(rates: Sequence[float], block_size: int) -> float:
    """E(b) = 1 + sum over i < b of the product of the first i conditional acceptance rates."""
    total, run = 1.0, 1.0
    for c in rates[: block_size - 1]:
        run *= c
        total += run
    return total


class _Tally:
    """Tokens by mode and cycles by block size, for the statistics."""

    def __init__(self):
        self.tokens = {"speculative": 0, "plain": 0, "probe": 0}
        self.sizes: dict[int, int] = {}

    def add(self, mode: str, block_size: int, tokens: int) -> None:
        self.tokens[mode] += tokens
        self.sizes[block_size] = self.sizes.get(block_size, 0) + 1

    def as_dict(self) -> dict:
        total = sum(self.tokens.values())
        return {
            "tokens_by_mode": dict(self.tokens),
            "share_by_mode": {m: (n / total if total else 0.0) for m, n in self.tokens.items()},
            "block_sizes": {str(b): n for b, n in sorted(self.sizes.items())},
        }


class FixedBlock:
    """``--block-size N``: every cycle has N rows (the loop as it was before the controller)."""

    def __init__(self, block_size: int):
        self.block_size, self.tally = block_size, _Tally()

    def choose(self, context_len: int) -> int:
        return self.block_size

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int) -> None:
        self.tally.add("speculative" if block_size > 1 else "plain", block_size, accepted + 1)

    def summary(self) -> dict:
        return {"policy": "fixed", **self.tally.as_dict(), "last_switch": None}


class ScheduledBlocks:
    """Block sizes from a list, repeated (tests force switching with it; calibration times with it).
    With ``costs``, it records there the time of every cycle that ran at its scheduled size."""

    def __init__(self, schedule: Sequence[int], costs: Optional[CostTable] = None):
        assert schedule and all(b >= 1 for b in schedule)
        self.schedule, self.costs, self.tally = list(schedule), costs, _Tally()
        self.chosen: deque[int] = deque()  # chosen, not yet observed (the loop chooses one ahead)
        self.calls = 0
        self.observed: list[tuple[int, int]] = []  # (block size, accepted) per cycle

    def choose(self, context_len: int) -> int:
        b = self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        self.chosen.append(b)
        return b

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int) -> None:
        # the loop clips the last blocks to max_tokens: those are not the scheduled size's cost
        if self.costs is not None and block_size == self.chosen.popleft():
            self.costs.observe(block_size, context_len, seconds)
        self.observed.append((block_size, accepted))
        self.tally.add("speculative" if block_size > 1 else "plain", block_size, accepted + 1)

    @property
    def finished(self) -> bool:
        """Every cycle of the schedule ran once (a calibration request may stop here)."""
        return len(self.observed) >= len(self.schedule)

    def summary(self) -> dict:
        return {"policy": "schedule", **self.tally.as_dict(), "last_switch": None}


def calibration_schedule(max_block: int, rounds: int = 3, run: int = 6) -> list[int]:
    """Rounds of runs of ``run`` cycles of each measured size (1, 2..max_block; past 8 every
    fourth): a run's first and last cycles share their time with the neighbouring run's (it was
    launched ahead, or launches the next), so only the ones between are timed; the rounds
    interleave the sizes, so that a slow spell of a shared machine hits them all."""
    sizes = [1] + [b for b in range(2, max_block + 1) if b <= 8 or b % 4 == 0 or b == max_block]
    return [b for _ in range(rounds) for b in sizes for _ in range(run)]


class BreakEvenController:
    """Per request: the block size with the most expected tokens per second, or plain steps with
    budgeted probes (module docstring)."""

    def __init__(
        self, profile: PairProfile, max_block: int, greedy: bool, temperature: float, probe_budget: float = PROBE_BUDGET
    ):
        self.profile, self.max_block = profile, max_block
        self.costs = profile.cost_table(greedy)
        self.pair = profile.acceptance(0.0 if greedy else temperature)
        self.mine = PositionAcceptance(profile.positions)
        self.probe_budget = probe_budget
        self.decode_seconds = 0.0  # this request's timed cycles
        self.probe_excess = 0.0  # what probes cost beyond the plain steps they replaced
        self.probe_count = 0
        self.mode = None  # "speculative" / "plain"; None before the first choice
        self.last_switch: Optional[str] = None
        self.probes: deque[bool] = deque()  # per chosen, not yet observed cycle: is it a probe
        self.tally = _Tally()
        self.plan: Optional[tuple] = None  # (best block, its rate / plain rate, bucket, ...), cached
        self.cycles = 0
        self.previous: Optional[int] = None  # the last observed cycle's block size
        self.since_plain = 0  # cycles since a plain step was timed
        self.refresh = 0  # plain steps still to run to re-time a plain step

    # -- the decision ---------------------------------------------------------------------------

    def _rates(self) -> list[float]:
        return self.mine.rates(self.pair, PRIOR_WEIGHT)

    def _best(self, context_len: int) -> tuple[int, float, float, float]:
        """(best block size >= 2, its expected tokens, its cost, a plain step's cost)."""
        rates = self._rates()
        step = self.costs.estimate(PLAIN, context_len)
        best = (2, 1.0, math.inf, step)
        for b in range(2, self.max_block + 1):
            cost = self.costs.estimate(b, context_len)
            if cost is None:
                continue
            e = expected_tokens(rates, b)
            if e / cost > best[1] / best[2]:
                best = (b, e, cost, step)
        return best

    def choose(self, context_len: int) -> int:
        if self.plan is None or self.plan[2] != bucket(context_len):
            b, e, cost, step = self._best(context_len)
            ratio = (e / cost) * step if step and cost < math.inf else math.inf
            self.plan = (b, ratio, bucket(context_len), e, cost, step)
        b, ratio, _, e, cost, step = self.plan
        steps = f"{cost / step:.2f}" if step else "?"
        stale = self.since_plain >= PLAIN_REFRESH or not self.costs.measured(PLAIN, context_len)
        if ratio > 1.0 and stale and not self.refresh:
            # a plain step's cost is only a guess while speculating (the calibration's, or another
            # context bucket's scaled like a block's, though attention over the context grows
            # with the rows): time a few
            self.refresh = PLAIN_RUN
        if ratio > 1.0 and self.refresh:
            self.refresh -= 1
            self.since_plain = 0
            self.probes.append(False)
            return PLAIN
        if ratio > 1.0:
            self._switch(
                "speculative",
                f"block {b} expects {e:.2f} tokens per {steps} plain steps ({ratio:.2f}x plain)",
                context_len,
            )
            self.probes.append(False)
            return b
        self._switch(
            "plain",
            f"the best block ({b}) expects {e:.2f} tokens per {steps} plain steps ({ratio:.2f}x plain)",
            context_len,
        )
        # One probe at a time (the loop chooses a cycle ahead: a second would be paid before the
        # first's outcome is known), priced at what this request's probes really cost: a probe
        # after a plain stretch runs a cold drafter and costs more than the cycles it was timed on.
        predicted = max(cost - step, self.probe_excess / self.probe_count if self.probe_count else 0.0)
        probe = not any(self.probes) and self.probe_excess + predicted <= self.probe_budget * (
            self.decode_seconds + cost
        )
        self.probes.append(probe)
        return b if probe else PLAIN

    def _switch(self, mode: str, why: str, context_len: int) -> None:
        if mode != self.mode:
            if self.mode is not None:
                self.last_switch = f"to {mode} at context {context_len}: {why}"
            self.mode = mode

    # -- what happened --------------------------------------------------------------------------

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int) -> None:
        self.cycles += 1
        self.decode_seconds += seconds
        if self.previous is not None and (self.previous > PLAIN) == (block_size > PLAIN):
            self.costs.observe(block_size, context_len, seconds)  # a steady cycle (module docstring)
        self.previous = block_size
        self.since_plain = 0 if block_size == PLAIN else self.since_plain + 1
        if block_size > PLAIN:
            self.mine.observe(block_size, accepted, REQUEST_DECAY)
            self.pair.observe(block_size, accepted, PAIR_DECAY)
            self.plan = None  # acceptance changed: decide again
        elif self.cycles % 16 == 0:
            self.plan = None  # plain steps refine only a cost: revisit now and then
        if self.probes.popleft():
            step = self.costs.estimate(PLAIN, context_len) or 0.0
            self.probe_excess += max(0.0, seconds - step)
            self.probe_count += 1
            self.tally.add("probe", block_size, accepted + 1)
        else:
            self.tally.add("speculative" if block_size > PLAIN else "plain", block_size, accepted + 1)

    def summary(self) -> dict:
        return {
            "policy": "auto",
            **self.tally.as_dict(),
            "mode": self.mode,
            "last_switch": self.last_switch,
            "probe_share_of_decode_time": self.probe_excess / self.decode_seconds if self.decode_seconds else 0.0,
        }


# Runs one short speculative request: (prompt, policy, max tokens) -> None, ending it as soon as the
# policy (a ScheduledBlocks) is ``finished``. The decoding side passes it in
# (decoding.speculative.run_calibration_request), so that the policy never imports the loop.
RunRequest = Callable[[Sequence[int], BlockPolicy, int], None]


def calibrate(runner, drafter, costs: CostTable, run_request: RunRequest) -> None:
    """Time real cycles of every block size (and plain steps) on a short made-up prompt: the
    costs a pair's first request decides with (medians), until its own cycles refine them."""
    prompt = [(7 * i + 3) % runner.vocab_size for i in range(16)]
    schedule = calibration_schedule(drafter.config.block_size)
    timed = _Timings(schedule)
    # a warm-up, then the timed run; each request ends when its schedule has run once
    # (``ScheduledBlocks.finished``): max_tokens only bounds a pair that accepts every draft
    for policy in (ScheduledBlocks(sorted(set(schedule))), timed):
        run_request(prompt, policy, sum(policy.schedule) + 1)
    sizes = sorted(timed.samples)
    medians = monotone([statistics.median(timed.samples[b]) for b in sizes])
    for b, seconds in zip(sizes, medians):
        costs.observe(b, len(prompt), seconds)


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


class _Timings(ScheduledBlocks):
    """The calibration schedule, keeping the times of cycles inside a run of one size."""

    def __init__(self, schedule: Sequence[int]):
        super().__init__(schedule)
        self.samples: dict[int, list[float]] = {}

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int) -> None:
        i = len(self.observed)
        inside = 0 < i < len(self.schedule) - 1 and self.schedule[i - 1] == self.schedule[i] == self.schedule[i + 1]
        if inside and block_size == self.schedule[i]:
            self.samples.setdefault(block_size, []).append(seconds)
        super().observe(block_size, accepted, seconds, context_len)


def policy_for(runner, drafter, settings, run_request: RunRequest) -> BlockPolicy:
    """The request's policy: the one given, a pinned block size, or the break-even controller
    (calibrating the pair's costs for this kind of sampling at its first use, with requests run by
    ``run_request`` at the settings' sampling)."""
    if settings.policy is not None:
        return settings.policy
    if settings.block_size:
        return FixedBlock(settings.block_size)
    greedy = settings.sampling.greedy
    ensure_calibrated(runner, drafter, greedy, run_request)
    return BreakEvenController(
        profile_for(runner.model, drafter), drafter.config.block_size, greedy, settings.sampling.temperature
    )


def ensure_calibrated(runner, drafter, greedy: bool, run_request: RunRequest) -> bool:
    """Calibrate the pair's greedy or sampled cycle costs (timing requests run by ``run_request``)
    unless done already; True if it ran. A server calls it while loading: a calibration takes a few hundred
    cycles, and run inside a request it would hold up every request beside it."""
    costs = profile_for(runner.model, drafter).cost_table(greedy)
    if costs.calibrated:
        return False
    calibrate(runner, drafter, costs, run_request)
    return True
