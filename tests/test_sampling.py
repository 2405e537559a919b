"""Sampled decoding draws exactly from the target's distribution: the keyed Gumbel-max draw itself,
and the tokens speculative sampling emits (which are plain sampled decoding's, token for token).

Statistical tests use a G-test at a stated false-alarm rate (ALPHA) with fixed seeds, so each run
is deterministic: a correct sampler passes with probability 1 - ALPHA for a given seed set, and
the seeds below are that one draw.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tiny

from dflash2_mlx.decoding.sampling import SamplingSettings, keyed_draw, probabilities
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.diagnostics.distribution import ALPHA, exact_joint, g_test_pvalue
from dflash2_mlx.models.target import TargetRunner


def _keyed_counts(logits, sampling, keys):
    """Counts [R, V] of the keyed draws of rows ``logits`` [R, V] over (seed, position) ``keys``."""
    counts = np.zeros(logits.shape)
    for seed, position in keys:
        drawn = np.array(keyed_draw(logits, sampling, seed, position))
        counts[np.arange(logits.shape[0]), drawn] += 1
    return counts


@pytest.mark.parametrize("keys", ["one position, many seeds", "one seed, many positions"])
def test_a_keyed_gumbel_max_draw_follows_p(keys):
    """argmax(log p + G_n) is a draw from p, whichever of the seed and the position varies; tokens
    the sampling settings exclude (top-p, top-k) are never drawn."""
    rng = np.random.default_rng(4)
    vocab, rows, n = 8, 3, 4000
    logits = mx.array(rng.normal(scale=1.5, size=(rows, vocab)).astype(np.float32))
    sampling = SamplingSettings(temperature=0.8, top_p=0.9, top_k=6)
    p = np.array(probabilities(logits, sampling))
    assert (p == 0).sum() >= rows * 2  # some tokens are excluded in every row
    pairs = [(s, 17) for s in range(n)] if keys == "one position, many seeds" else [(2026, 3 * j) for j in range(n)]
    counts = _keyed_counts(logits, sampling, pairs)
    assert counts[p == 0].sum() == 0
    for i in range(rows):  # row i's draws use position + i: another stream, with the same law
        assert g_test_pvalue(counts[i], p[i]) > ALPHA


def test_keyed_draws_at_different_positions_are_independent():
    """The joint of two rows' draws (positions n and n + 1 of one seed) is the product of p's."""
    rng = np.random.default_rng(5)
    vocab, n = 5, 5000
    logits = mx.array(rng.normal(size=(2, vocab)).astype(np.float32))
    sampling = SamplingSettings(temperature=1.0)
    p = np.array(probabilities(logits, sampling))
    joint = np.zeros((vocab, vocab))
    for seed in range(n):
        first, second = keyed_draw(logits, sampling, seed, 40).tolist()
        joint[first, second] += 1
    assert g_test_pvalue(joint.ravel(), np.outer(p[0], p[1]).ravel()) > ALPHA


def test_the_g_test_detects_a_wrong_sampler():
    """The statistical test has power: draws from a q other than p are caught."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6))
    q = rng.dirichlet(np.ones(6))
    draws = np.random.default_rng(1).choice(6, size=4000, p=q)
    assert g_test_pvalue(np.bincount(draws, minlength=6).astype(float), p) < ALPHA


def _exact_joint(runner, prompt, n_tokens, sampling, vocab):
    """P(t1..tn | prompt) for every sequence, from the target's processed distributions."""

    def next_probs(generated):
        logits, _ = runner(mx.array([list(prompt) + list(generated)]), runner.make_cache())
        return np.array(probabilities(logits[0, -1:], sampling))[0]

    table = np.zeros((vocab,) * n_tokens)
    for seq, p in exact_joint(next_probs, n_tokens).cells.items():
        table[seq] = p
    return table


@pytest.mark.parametrize("version", [1, 2])
def test_speculative_sampling_matches_the_targets_joint_distribution(version):
    """The first three generated tokens (one from prefill, two from the first cycle's draft,
    accept/reject and bonus) follow the target's exact joint distribution."""
    _joint_distribution_test(version, lambda: {"block_size": 3})


@pytest.mark.parametrize("policy", ["plain step then a block", "break-even controller"])
def test_sampling_with_the_controller_matches_the_targets_joint_distribution(policy):
    """Plain steps inside the speculative loop, a block after them (drafted and verified ahead of
    the plain step's host sync), and the real controller's own choices (which depend only on
    the past, whatever the machine's timings) keep the exact joint distribution."""
    from dflash2_mlx.policies.block_size import ScheduledBlocks

    # n = 400: these paths differ from the fixed loop's in where the tokens come from (a plain
    # step's row, an anchor not yet read), and such bugs are gross (lambda in the thousands above)
    if policy == "plain step then a block":
        _joint_distribution_test(2, lambda: {"policy": ScheduledBlocks([1, 2])}, n=400)
    else:
        _joint_distribution_test(2, lambda: {}, n=400)


def test_sampling_with_a_draft_vocabulary_matches_the_targets_joint_distribution():
    """A drafter scoring only some token ids (its draft vocabulary) proposes from q over those;
    tokens outside it are never drafted, yet the target's joint distribution is kept."""
    _joint_distribution_test(2, lambda: {"block_size": 3}, n=400, draft_vocab=[0, 2, 3, 4])


def _joint_distribution_test(version, block_settings, n=1500, draft_vocab=None):
    vocab = 6
    cfg = tiny.hybrid_config(vocab=vocab, hidden=32)
    model = tiny.build_target(cfg, seed=3, scale=1.5)
    runner = TargetRunner(model)
    sampling = SamplingSettings(temperature=0.9, top_p=0.95)
    prompt = [1, 4, 2]
    exact = _exact_joint(runner, prompt, 3, sampling, vocab).ravel()
    assert exact.sum() == pytest.approx(1.0, abs=1e-4)
    dcfg = tiny.drafter_config(cfg, version=version, block_size=4, mask_token_id=vocab - 1, top_k=3)
    drafter = tiny.build_drafter(dcfg, seed=5)
    if draft_vocab is not None:
        drafter.set_draft_vocab(mx.array(draft_vocab, dtype=mx.int32))
    counts = np.zeros_like(exact)
    accepted_any = 0
    # Each draw is a whole generation (~15-30 ms, nearly all per-op overhead; the engine decodes a
    # batch of one, so draws cannot be vectorised), so n sets this test's cost. Every generated
    # token is the request's keyed draw at its position, so the drafter only changes how many
    # draws a cycle keeps, never the tokens: bugs show up as a wrong joint. The G statistic of
    # draws from deliberately broken engines (same seeds, n = 1500, df 61 after pooling) gives
    # each bug's noncentrality lambda = G - df (a correct engine: G 59.1):
    #   bug                                                    lambda, v1 / v2    power at ALPHA
    #   verify rows keyed one position early (row 0 reuses            971 / 971             1.0
    #     the noise of the token before the block)
    #   bonus taken from the row after the first refusal              1233 / 2068            1.0
    #   verify draws keyed by a fixed seed, not the request's            - / 6768            1.0
    # (A wrong bonus row after a full block is invisible here at any n: with 3 tokens it is clipped.)
    for seed in range(n):
        settings = GenerationSettings(max_tokens=3, sampling=sampling, seed=seed, **block_settings())
        events = list(generate_speculative(runner, drafter, prompt, settings))
        toks = [t for e in events for t in e.tokens]
        counts[np.ravel_multi_index(toks, (vocab,) * 3)] += 1
        accepted_any += any((e.accepted or 0) > 0 for e in events)
    if "block_size" in block_settings():
        assert 0.1 * n < accepted_any < n  # both acceptance and rejection paths were exercised
    assert g_test_pvalue(counts, exact) > ALPHA
