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

from dflash2_mlx.policies.copy_length import CopyEstimates, CopyHistory
from dflash2_mlx.policies.estimates import CostTable, PositionAcceptance, bucket, expected_tokens, monotone

PLAIN = 1
PROBE_BUDGET = 0.01  # of decode time; the documented bound (3%) leaves room for mispredicted probes
PRIOR_WEIGHT = 2.0  # the pair's history counts as at most this many cycles of the request's own
REQUEST_DECAY = 0.93  # per cycle: a request's acceptance follows its text (code, prose, a tool call)
PAIR_DECAY = 0.98  # per cycle: the pair's history spans a few requests
PLAIN_REFRESH = 48  # speculative cycles after which a few plain steps re-time a plain step (symmetric to probes)
PLAIN_RUN = 3  # plain steps per refresh: the later ones are timed in their steady state


class BlockPolicy(Protocol):
    """What the decode loop asks before and tells after each cycle."""

    def choose(self, context_len: int) -> int:
        """Block size of the next cycle: 1 (a plain step) or 2..B."""

    def choose_copy(self, context_len: int, agreement: int, available: int) -> int:
        """How many of ``available`` copied tokens (a match of the context that agreed on
        ``agreement`` tokens) the next cycle verifies instead of what ``choose`` said; 0: none."""

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int, copied: int = 0) -> None:
        """A cycle of ``block_size`` accepted ``accepted`` drafts and took ``seconds``;
        ``copied``: the agreement of its copy draft (0: the drafter's block or a plain step)."""

    def summary(self) -> dict:
        """What the policy did (``generate --json``'s ``controller`` object)."""


@dataclass
class PairProfile:
    """What a loaded (target, drafter) pair has measured: costs per mode, acceptance per temperature."""

    positions: int
    costs: dict = field(default_factory=dict)  # "greedy" / "sampled" -> CostTable
    history: dict = field(default_factory=dict)  # temperature -> PositionAcceptance
    copy: CopyHistory = field(default_factory=CopyHistory)  # copy drafts' costs and acceptance

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


class _Tally:
    """Tokens by mode and cycles by block size, for the statistics."""

    def __init__(self):
        self.tokens = {"speculative": 0, "copy": 0, "plain": 0, "probe": 0}
        self.sizes: dict[int, int] = {}
        self.copy_sizes: dict[int, int] = {}

    def add(self, mode: str, block_size: int, tokens: int) -> None:
        self.tokens[mode] += tokens
        sizes = self.copy_sizes if mode == "copy" else self.sizes
        sizes[block_size] = sizes.get(block_size, 0) + 1

    def as_dict(self) -> dict:
        total = sum(self.tokens.values())
        return {
            "tokens_by_mode": dict(self.tokens),
            "share_by_mode": {m: (n / total if total else 0.0) for m, n in self.tokens.items()},
            "block_sizes": {str(b): n for b, n in sorted(self.sizes.items())},
            "copy_sizes": {str(b): n for b, n in sorted(self.copy_sizes.items())},
        }

    def mode(self, block_size: int, copied: int, probe: bool = False) -> str:
        return "copy" if copied else "probe" if probe else "speculative" if block_size > PLAIN else "plain"


class FixedBlock:
    """``--block-size N``: every cycle has N rows (the loop as it was before the controller)."""

    def __init__(self, block_size: int):
        self.block_size, self.tally = block_size, _Tally()

    def choose(self, context_len: int) -> int:
        return self.block_size

    def choose_copy(self, context_len: int, agreement: int, available: int) -> int:
        return 0  # a pinned block size measures the drafter alone

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int, copied: int = 0) -> None:
        self.tally.add(self.tally.mode(block_size, copied), block_size, accepted + 1)

    def summary(self) -> dict:
        return {"policy": "fixed", **self.tally.as_dict(), "last_switch": None}


class ScheduledBlocks:
    """Block sizes from a list, repeated (tests force switching with it; calibration times with it).
    With ``costs``, it records there the time of every cycle that ran at its scheduled size.
    ``copies``: copied tokens to verify each time the context offers a copy draft, repeated (0:
    not that time); empty, it never copies."""

    def __init__(self, schedule: Sequence[int], costs: Optional[CostTable] = None, copies: Sequence[int] = ()):
        assert schedule and all(b >= 1 for b in schedule)
        self.schedule, self.costs, self.tally = list(schedule), costs, _Tally()
        self.copies, self.copy_calls = list(copies), 0
        self.chosen: deque[int] = deque()  # chosen, not yet observed (the loop chooses one ahead)
        self.calls = 0
        self.observed: list[tuple[int, int]] = []  # (block size, accepted) per cycle

    def choose(self, context_len: int) -> int:
        b = self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        self.chosen.append(b)
        return b

    def choose_copy(self, context_len: int, agreement: int, available: int) -> int:
        if not self.copies:
            return 0
        self.copy_calls += 1
        return min(self.copies[(self.copy_calls - 1) % len(self.copies)], available)

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int, copied: int = 0) -> None:
        # the loop clips the last blocks to max_tokens: those are not the scheduled size's cost
        chosen = self.chosen.popleft() if self.chosen else None
        if self.costs is not None and block_size == chosen and not copied:
            self.costs.observe(block_size, context_len, seconds)
        self.observed.append((block_size, accepted))
        self.tally.add(self.tally.mode(block_size, copied), block_size, accepted + 1)

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
        self.copying = CopyEstimates(profile.copy, self.costs, max_block, greedy, temperature)

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

    def _plan(self, context_len: int) -> tuple:
        """(best block, its rate / a plain step's, bucket, its expected tokens, its cost, a plain
        step's cost), decided again when acceptance changed or the context changed bucket."""
        if self.plan is None or self.plan[2] != bucket(context_len):
            b, e, cost, step = self._best(context_len)
            ratio = (e / cost) * step if step and cost < math.inf else math.inf
            self.plan = (b, ratio, bucket(context_len), e, cost, step)
        return self.plan

    def choose(self, context_len: int) -> int:
        b, ratio, _, e, cost, step = self._plan(context_len)
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

    def choose_copy(self, context_len: int, agreement: int, available: int) -> int:
        """Copy when the best copy size expects more tokens per second than the block the plan
        would run, or than a plain step where no block pays."""
        rows, e, cost = self.copying.best(agreement, available, context_len)
        if not rows:
            return 0
        b, ratio, _, e_block, cost_block, step = self._plan(context_len)
        rival = e_block / cost_block if ratio > 1.0 else (1.0 / step if step else 0.0)
        return rows - 1 if e / cost > rival else 0

    def _switch(self, mode: str, why: str, context_len: int) -> None:
        if mode != self.mode:
            if self.mode is not None:
                self.last_switch = f"to {mode} at context {context_len}: {why}"
            self.mode = mode

    # -- what happened --------------------------------------------------------------------------

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int, copied: int = 0) -> None:
        self.cycles += 1
        self.decode_seconds += seconds
        if copied:  # a copy cycle ran instead of the chosen one: it refines only copy estimates
            self.copying.observe(block_size, accepted, seconds, context_len, copied)
            self.previous = None  # the next block's drafter first takes in this cycle's rows
            self.since_plain += 1
            if self.probes:  # the cycle chosen for this turn was replaced by the copy
                self.probes.popleft()
            self.tally.add("copy", block_size, accepted + 1)
            return
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


class _Timings(ScheduledBlocks):
    """The calibration schedule, keeping the times of cycles inside a run of one size."""

    def __init__(self, schedule: Sequence[int]):
        super().__init__(schedule)
        self.samples: dict[int, list[float]] = {}

    def observe(self, block_size: int, accepted: int, seconds: float, context_len: int, copied: int = 0) -> None:
        i = len(self.observed)
        inside = 0 < i < len(self.schedule) - 1 and self.schedule[i - 1] == self.schedule[i] == self.schedule[i + 1]
        if inside and block_size == self.schedule[i] and not copied:
            self.samples.setdefault(block_size, []).append(seconds)
        super().observe(block_size, accepted, seconds, context_len, copied)


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
