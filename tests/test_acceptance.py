"""The greedy accept rule on hand-made verify logits (the sampled rule's distribution is tested in
test_sampling.py): the longest prefix of drafts equal to the target's argmax is kept, and the bonus
is the target's argmax right after it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash2_mlx.decoding.acceptance import accept_greedy, accept_rule, accept_sampled, plain_step_token
from dflash2_mlx.decoding.sampling import SamplingSettings

VOCAB = 10


def _logits_preferring(tokens: list[int]) -> mx.array:
    """Verify logits [len(tokens), VOCAB] whose row i has its argmax at tokens[i]."""
    rows = mx.zeros((len(tokens), VOCAB))
    return rows + mx.eye(VOCAB)[mx.array(tokens)] * 5.0


@pytest.mark.parametrize(
    "drafts, target, accepted, bonus",
    [
        ([3, 4, 5], [3, 4, 5, 6], 3, 6),  # every draft agrees: the bonus comes from the last row
        ([3, 4, 5], [3, 4, 7, 6], 2, 7),  # the first disagreement ends the kept prefix
        ([3, 4, 5], [1, 4, 5, 6], 0, 1),  # later agreement after a disagreement counts for nothing
        ([3], [3, 2], 1, 2),
    ],
)
def test_greedy_keeps_the_longest_agreeing_prefix_and_adds_the_targets_next_token(drafts, target, accepted, bonus):
    verdict = accept_greedy(mx.array(drafts, dtype=mx.int32), _logits_preferring(target))
    assert verdict.accepted.shape == (1,) and verdict.accepted.item() == accepted
    assert verdict.bonus.shape == (1,) and verdict.bonus.item() == bonus


def test_the_rule_is_chosen_by_the_sampling_settings():
    assert accept_rule(SamplingSettings(temperature=0.0)) is accept_greedy
    assert accept_rule(SamplingSettings(temperature=0.7)).func is accept_sampled


def test_a_plain_step_at_temperature_zero_takes_the_rows_argmax():
    assert plain_step_token(_logits_preferring([8]), SamplingSettings(temperature=0.0)).tolist() == [8]
