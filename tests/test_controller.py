"""The break-even controller: its arithmetic and decisions, on simulated cycles (no model).

A simulated request feeds the controller the cycles a pair with known costs and per-position
acceptance would produce; the decisions are then checked against what the costs imply. The
timings are made up, so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import random

import pytest

from dflash2_mlx.policies.block_size import (
    PLAIN,
    BreakEvenController,
    CostTable,
    PairProfile,
    bucket,
    expected_tokens,
    monotone,
)

MAX_BLOCK = 8


def _profile(step: float, per_row: float, base: float) -> PairProfile:
    """A pair whose plain step costs ``step`` and a block of b costs base + per_row * b."""
    profile = PairProfile(MAX_BLOCK - 1)
    costs = profile.cost_table(greedy=True)
    costs.observe(PLAIN, 16, step)
    for b in range(2, MAX_BLOCK + 1):
        costs.observe(b, 16, base + per_row * b)
    return profile


def _simulate(controller, rate: float, cycles: int, step: float, per_row: float, base: float, seed: int = 0):
    """Run ``cycles`` cycles where each draft is accepted with probability ``rate`` (given the
    ones before were): returns the block sizes chosen, the tokens and the seconds spent."""
    rng = random.Random(seed)
    sizes, tokens, seconds = [], 0, 0.0
    context = 16
    for _ in range(cycles):
        b = controller.choose(context)
        accepted = 0
        while accepted < b - 1 and rng.random() < rate:
            accepted += 1
        t = step if b == PLAIN else base + per_row * b
        controller.observe(b, accepted, t, context)
        sizes.append(b)
        tokens += accepted + 1
        seconds += t
        context += accepted + 1
    return sizes, tokens, seconds


def test_expected_tokens_is_one_plus_the_sum_of_prefix_acceptance_probabilities():
    rates = [0.5, 0.5, 1.0]
    assert expected_tokens(rates, 1) == 1.0
    assert expected_tokens(rates, 2) == 1.5
    assert expected_tokens(rates, 3) == 1.75
    assert expected_tokens(rates, 4) == 2.0


def test_a_well_matched_pair_speculates_with_the_block_that_pays_most():
    # a block of b costs 1 + 0.1 b plain steps; with 95% acceptance the biggest block wins
    profile = _profile(step=1.0, per_row=0.1, base=1.0)
    controller = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    sizes, tokens, seconds = _simulate(controller, 0.95, 200, 1.0, 0.1, 1.0)
    assert sizes[-50:].count(MAX_BLOCK) >= 45
    assert tokens / seconds > 2.5  # tokens per plain-step time: well above plain decoding's 1.0


def test_a_poor_pair_decodes_plainly_and_probes_within_the_budget():
    # a block costs 2.5-3.2 steps and accepts 20%: no block pays
    profile = _profile(step=1.0, per_row=0.1, base=2.4)
    controller = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    sizes, tokens, seconds = _simulate(controller, 0.2, 3000, 1.0, 0.1, 2.4)
    assert sizes[-2000:].count(PLAIN) > 0.95 * 2000
    probes = sum(1 for b in sizes[1000:] if b > PLAIN)
    assert probes >= 5  # it keeps looking
    summary = controller.summary()
    assert summary["probe_share_of_decode_time"] <= 0.03
    assert summary["share_by_mode"]["plain"] > 0.9 and summary["mode"] == "plain"
    assert summary["last_switch"].startswith("to plain")
    assert tokens / seconds > 0.97  # never much slower than plain decoding


def test_probes_go_one_at_a_time_and_are_priced_at_what_they_really_cost():
    # The loop chooses a cycle before it observes the one before, as the engine does; a probe
    # after a plain stretch runs a cold drafter: here it costs twice its cost table's figure.
    profile = _profile(step=1.0, per_row=0.1, base=2.4)
    controller = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    rng = random.Random(3)
    planned, context, sizes, seconds, probe_seconds = controller.choose(16), 16, [], 0.0, 0.0
    for _ in range(4000):
        b = planned
        accepted = sum(1 for _ in range(b - 1) if rng.random() < 0.1) if b > PLAIN else 0
        cold = b > PLAIN and sizes and sizes[-1] == PLAIN
        t = 1.0 if b == PLAIN else (2.4 + 0.1 * b) * (2.0 if cold else 1.0)
        planned = controller.choose(context + accepted + 1)  # before this cycle's outcome is known
        probe = controller.probes[0]
        controller.observe(b, accepted, t, context)
        if probe:
            probe_seconds += t - 1.0
        sizes.append(b)
        seconds += t
        context += accepted + 1
    later = sizes[200:]
    assert not any(a > PLAIN and b > PLAIN for a, b in zip(later, later[1:]))  # never two probes in a row
    assert sum(1 for b in later if b > PLAIN) >= 5  # it keeps looking
    assert probe_seconds / seconds <= 0.015  # the 1% budget, overrun by at most one probe
    assert controller.summary()["probe_share_of_decode_time"] == pytest.approx(probe_seconds / seconds, rel=0.05)


def test_a_block_after_plain_steps_does_not_set_the_blocks_steady_cost():
    # Block 2 costs 1.1 plain steps in a run of blocks and accepts 30%: 1.18x plain, it pays. The
    # first block after plain steps (a probe, or the end of a plain-step re-timing) costs 1.6:
    # timed into the table, it made block 2 look like a loss and held the request plain.
    profile = _profile(step=1.0, per_row=0.5, base=0.1)  # bigger blocks cost too much to pay
    controller = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    rng = random.Random(5)
    sizes, context = [], 16
    for _ in range(1500):
        b = controller.choose(context)
        accepted = sum(1 for _ in range(b - 1) if rng.random() < 0.3)
        after_plain = b > PLAIN and (not sizes or sizes[-1] == PLAIN)
        seconds = 1.0 if b == PLAIN else 0.1 + 0.5 * b + (0.5 if after_plain else 0.0)
        controller.observe(b, accepted, seconds, context)
        sizes.append(b)
        context += accepted + 1
    assert sizes[-500:].count(2) > 0.9 * 500


def test_probes_notice_when_acceptance_recovers():
    profile = _profile(step=1.0, per_row=0.1, base=1.0)
    controller = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    # a block of b costs 1 + 0.1 b: at 5% acceptance nothing pays, at 90% big blocks do
    _simulate(controller, 0.05, 400, 1.0, 0.1, 1.0, seed=1)
    assert controller.mode == "plain"
    sizes, _, _ = _simulate(controller, 0.9, 600, 1.0, 0.1, 1.0, seed=2)
    assert controller.mode == "speculative" and sizes[-100:].count(PLAIN) < 10  # only plain-step re-timings
    assert controller.summary()["last_switch"].startswith("to speculative")


def test_the_pairs_history_is_the_next_requests_prior():
    profile = _profile(step=1.0, per_row=0.1, base=2.4)
    first = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    _simulate(first, 0.1, 100, 1.0, 0.1, 2.4)
    second = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    assert second.choose(16) == PLAIN  # it starts plainly: the pair is known to lose at this temperature
    other_temperature = BreakEvenController(profile, MAX_BLOCK, greedy=False, temperature=0.7)
    other_temperature.costs.observe(PLAIN, 16, 1.0)
    for b in range(2, MAX_BLOCK + 1):
        other_temperature.costs.observe(b, 16, 2.4 + 0.1 * b)
    assert other_temperature.choose(16) > PLAIN  # no history there: a pair is first assumed to speculate well


def test_a_known_pairs_poor_history_keeps_a_request_from_speculating_at_a_loss():
    # block 2 costs 1.12 plain steps and is accepted 10% of the time (1.10 tokens): plain pays.
    # The pair's history says 10%: a request starts there, not at the optimistic prior for new pairs
    profile = _profile(step=1.0, per_row=0.06, base=1.0)
    history = profile.acceptance(0.0)
    for i in range(60):
        history.observe(2, int(i % 10 == 0), 0.98)
    controller = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    assert controller._rates()[0] == pytest.approx(0.1, abs=0.02)
    sizes, _, _ = _simulate(controller, 0.1, 40, 1.0, 0.06, 1.0, seed=3)
    assert sizes.count(PLAIN) >= 36  # a probe or so, no stretch of losing blocks


def test_a_launched_verify_pass_is_charged_to_its_own_cycle_and_a_drafted_one_is_not(monkeypatch):
    # on the CPU backend launching a pass waits for most of its compute: a plain step that
    # launches the next cycle's pass hands that time on; a block that only drafts ahead keeps it
    from dflash2_mlx.decoding import hooks

    now = iter([0.0, 0.004, 0.054, 0.056, 1.0, 1.002, 1.010, 2.0, 2.001, 2.060])
    monkeypatch.setattr(hooks.time, "perf_counter", lambda: next(now))
    clock = hooks.CycleClock()
    clock.start_cycle()  # a plain step whose launch (50 ms) computes the next cycle's pass
    clock.start_launch()
    clock.end_launch(next_pass_launched=True)
    assert clock.cycle_seconds() == pytest.approx(0.006)
    clock.start_cycle()  # that cycle: its launch drafts ahead only, so it keeps it
    clock.start_launch()
    clock.end_launch(next_pass_launched=False)
    assert clock.cycle_seconds() == pytest.approx(0.010 + 0.050)
    clock.start_cycle()  # the next one built and launched its own pass: all its time is its own
    clock.start_launch()
    clock.end_launch(next_pass_launched=False)
    assert clock.cycle_seconds() == pytest.approx(0.060)


def test_costs_are_per_context_bucket_and_borrow_the_nearest_buckets_shape():
    table = CostTable()
    for b, t in ((1, 1.0), (2, 2.0), (4, 3.0)):
        table.observe(b, 100, t)
    assert bucket(100) == 0 and bucket(600) == 1 and bucket(3000) == 3
    assert table.estimate(3, 100) == pytest.approx(2.5)  # interpolated between measured sizes
    table.observe(1, 3000, 2.0)  # at long context a plain step is twice as dear
    assert table.estimate(4, 3000) == pytest.approx(6.0)
    assert table.estimate(4, 100) == pytest.approx(3.0)


def test_a_slower_machine_moves_every_size_not_only_the_one_timed():
    table = CostTable()
    table.observe(1, 10, 1.0)
    table.observe(4, 10, 3.0)
    for _ in range(30):
        table.observe(4, 10, 6.0)  # everything got twice as slow; only blocks of 4 are running
    assert table.estimate(4, 10) == pytest.approx(6.0, rel=0.01)
    assert table.estimate(1, 10) == pytest.approx(2**0.5, rel=0.01)  # followed halfway, in log terms


def test_calibration_medians_are_made_monotone_in_block_size():
    assert monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


def test_a_plain_step_overestimated_by_calibration_is_re_timed_while_speculating():
    # calibration (a noisy moment) said a plain step costs 3; it costs 1, and blocks 2.6-3.2 at
    # 30% acceptance never pay: a few plain steps every PLAIN_REFRESH cycles find that out
    profile = _profile(step=3.0, per_row=0.1, base=2.4)
    controller = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    sizes, tokens, seconds = _simulate(controller, 0.3, 600, 1.0, 0.1, 2.4)
    assert sizes[:20].count(PLAIN) < 5 and sizes[-200:].count(PLAIN) > 190
    assert controller.summary()["last_switch"].startswith("to plain")


def test_at_a_longer_context_a_plain_step_is_timed_before_blocks_are_trusted():
    # calibrated at short context, where blocks pay; at 3000 tokens a block costs 4x more but a
    # plain step only 1.2x: the controller times plain steps there and stops speculating
    profile = _profile(step=1.0, per_row=0.1, base=1.0)
    controller = BreakEvenController(profile, MAX_BLOCK, greedy=True, temperature=0.0)
    _simulate(controller, 0.6, 50, 1.0, 0.1, 1.0)
    chosen = []
    for _ in range(60):
        b = controller.choose(3000)
        chosen.append(b)
        controller.observe(b, 1 if b > PLAIN else 0, 1.2 if b == PLAIN else 4 * (1 + 0.1 * b), 3000)
    assert chosen[:3].count(PLAIN) >= 1 and chosen[-20:].count(PLAIN) >= 19


def test_calibration_times_the_cycles_of_the_requests_it_is_given_to_run():
    # The controller never imports the decoding loop: the loop hands calibration a callable that
    # runs one request under a block schedule. Here the "request" reports made-up cycle times.
    from types import SimpleNamespace

    from dflash2_mlx.policies.block_size import calibrate

    def cost(block_size: int) -> float:
        return 1.0 if block_size == PLAIN else 1.5 + 0.25 * block_size

    runs = []

    def run_request(prompt, policy, max_tokens):
        runs.append((list(prompt), max_tokens))
        for _ in range(len(policy.schedule)):
            b = policy.choose(len(prompt))
            policy.observe(b, 0, cost(b), len(prompt))

    runner = SimpleNamespace(vocab_size=50)
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=MAX_BLOCK))
    costs = CostTable()
    calibrate(runner, drafter, costs, run_request)
    assert len(runs) == 2  # a warm-up, then the timed run
    prompt, max_tokens = runs[1]
    assert len(prompt) == 16 and all(0 <= t < 50 for t in prompt)
    assert max_tokens > MAX_BLOCK
    for b in range(1, MAX_BLOCK + 1):
        assert costs.estimate(b, len(prompt)) == pytest.approx(cost(b))


def test_the_controller_imports_nothing_of_the_decoding_loop():
    # policies sit below the decoding loop: any import of it from policies/block_size.py (even inside a
    # function) is the old controller <-> engine cycle
    import ast
    from pathlib import Path

    source = Path(__file__).parent.parent / "dflash2_mlx" / "policies" / "block_size.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    package_modules = {
        name.lstrip(".").removeprefix("dflash2_mlx.")
        for name in imported
        if name.startswith(".") or name.startswith("dflash2_mlx")
    }
    assert not {m for m in package_modules if m.split(".")[0] in ("engine", "decoding")}, package_modules


def test_a_calibration_request_ends_when_its_schedule_has_run_once(plain_target):
    # max_tokens is sized for a pair that accepts every draft; a drafter that is never accepted
    # (random weights) must not run the schedule over and over until it is spent
    import tiny

    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.decoding.speculative import run_calibration_request
    from dflash2_mlx.policies.block_size import ScheduledBlocks, calibration_schedule

    cfg, model = plain_target
    runner = tiny.runner_for(model)
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8))
    schedule = calibration_schedule(drafter.config.block_size)
    policy = ScheduledBlocks(schedule)
    run_calibration_request(runner, drafter, SamplingSettings(), [3, 4, 5, 6], policy, sum(schedule) + 1)
    assert policy.finished
    assert len(schedule) <= len(policy.observed) <= len(schedule) + 1
