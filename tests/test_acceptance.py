"""The accept rules on hand-made verify logits (the sampled rule's distribution is tested in
test_sampling.py): the longest prefix of drafts equal to the target's own picks is kept (greedy its
argmax, sampled its keyed draw for each row's position), and the bonus is its pick right after it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash2_mlx.decoding.acceptance import accept_greedy, accept_rule, accept_sampled, plain_step_token
from dflash2_mlx.decoding.sampling import SamplingSettings, keyed_draw

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
    assert accept_rule(SamplingSettings(temperature=0.0), seed=1) is accept_greedy
    rule = accept_rule(SamplingSettings(temperature=0.7), seed=1)
    assert rule.func is accept_sampled and rule.keywords["seed"] == 1


def test_a_plain_step_at_temperature_zero_takes_the_rows_argmax():
    assert plain_step_token(_logits_preferring([8]), SamplingSettings(temperature=0.0), 0, 5).tolist() == [8]


SAMPLED = SamplingSettings(temperature=1.0, top_p=0.9)


def _flat_logits(rows: int) -> mx.array:
    """Rows of logits under which many tokens are likely: keyed draws differ from row to row."""
    return mx.array([[0.3 * ((i * 7 + v * 3) % 5) for v in range(VOCAB)] for i in range(rows)])


@pytest.mark.parametrize("agree", [0, 1, 2, 3])
def test_sampled_keeps_the_drafts_equal_to_the_targets_keyed_draws_at_their_positions(agree):
    """Row i of a block after the anchor at position n draws position n + 1 + i: drafts equal to
    those draws are kept up to the first that differs, and the bonus is the draw right after."""
    seed, anchor_position, logits = 77, 12, _flat_logits(4)
    draws = [int(keyed_draw(logits[i : i + 1], SAMPLED, seed, anchor_position + 1 + i).item()) for i in range(4)]
    assert draws == keyed_draw(logits, SAMPLED, seed, anchor_position + 1).tolist()  # row by row or as a block
    drafts = draws[:3]
    if agree < 3:
        drafts[agree] = (drafts[agree] + 1) % VOCAB
    verdict = accept_sampled(mx.array(drafts, dtype=mx.int32), logits, anchor_position, SAMPLED, seed)
    assert verdict.accepted.tolist() == [agree] and verdict.bonus.tolist() == [draws[agree]]
    # a plain step predicting the same position draws the same token
    step = plain_step_token(logits[agree : agree + 1], SAMPLED, seed, anchor_position + 1 + agree)
    assert step.tolist() == [draws[agree]]


def test_sampled_draws_depend_on_the_seed_and_the_position():
    logits = mx.broadcast_to(_flat_logits(1), (64, VOCAB))
    by_position = keyed_draw(logits, SAMPLED, 5, 0).tolist()
    assert len(set(by_position)) > 2  # positions draw independently
    assert keyed_draw(logits, SAMPLED, 6, 0).tolist() != by_position  # so do seeds
    assert keyed_draw(logits, SAMPLED, 5 + 2**64, 0).tolist() == by_position  # seeds are taken mod 2**64
