"""serve --batch-verify: on and off are fixed; auto runs whichever mode its measurements say is faster."""

from __future__ import annotations

import pytest

from dflash2_mlx.policies.batch_switch import BatchSwitch


def _serve(switch: BatchSwitch, requests: int, rounds: int, batched_s: float, in_turn_s: float) -> list[bool]:
    choices = []
    for _ in range(rounds):
        batched = switch.batch(requests)
        switch.record(requests, batched, batched_s if batched else in_turn_s)
        choices.append(batched)
    return choices


def test_on_batches_every_round_of_two_or_more_and_off_none():
    assert _serve(BatchSwitch("on"), 3, 5, 1.0, 0.1) == [True] * 5
    assert _serve(BatchSwitch("off"), 3, 5, 0.1, 1.0) == [False] * 5
    assert not BatchSwitch("on").batch(1)  # one request: nothing to batch


@pytest.mark.parametrize("batched_s,in_turn_s,winner", [(0.05, 0.09, True), (0.09, 0.05, False)])
def test_auto_settles_on_the_faster_mode_and_keeps_probing_the_other(batched_s, in_turn_s, winner):
    switch = BatchSwitch("auto", probe_every=10, warmup=3)
    choices = _serve(switch, 2, 200, batched_s, in_turn_s)
    assert choices[:6].count(True) == choices[:6].count(False) == 3  # both measured first
    settled = choices[6:]
    assert settled.count(winner) >= 0.85 * len(settled)
    assert settled.count(not winner) >= len(settled) // 10 - 1  # probes


def test_auto_follows_a_change_in_which_mode_is_faster():
    switch = BatchSwitch("auto", probe_every=5, warmup=2)
    _serve(switch, 4, 50, 0.05, 0.09)
    later = _serve(switch, 4, 100, 0.09, 0.05)
    assert later[-50:].count(False) >= 40


def test_auto_measures_each_round_size_apart():
    switch = BatchSwitch("auto", probe_every=50, warmup=2)
    _serve(switch, 2, 30, 0.09, 0.05)  # two requests: in turn is faster
    _serve(switch, 4, 30, 0.05, 0.20)  # four: batched is
    assert not switch.batch(2) and switch.batch(4)
    assert set(switch.summary()) == {2, 4}


def test_an_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="auto, on, off"):
        BatchSwitch("sometimes")
