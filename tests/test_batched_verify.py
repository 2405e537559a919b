"""Batched verify: several sequences' verify passes in one target call, each exactly its own.

Every sequence's logits, features and cache after a batched pass equal its solo pass's (within
the float rounding the rollback tests allow), rollback with each one's own accepted count equals
solo rollback, and greedy decoding under batched verify gives every sequence its solo output
token for token, with ragged prompt lengths, block sizes and accepted counts (oracle drafters
force every accepted count).
"""

from __future__ import annotations

import random
from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_rollback import _assert_caches_equal

from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.batched_verify import VerifyRequest, run_together, step_together, verify_batch, verify_one
from dflash2_mlx.decoding.speculative import generate_speculative, speculative_steps
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models import target as target_module
from dflash2_mlx.models.target import TargetRunner

# a block pass against rows fed one by one (as the rollback tests), but a batch of N blocks is one
# matmul of N x S rows: with weight views and oneMKL, an 18-row and a 1-row matmul round apart by
# up to 1.4e-4 in the logits here
ATOL = 2e-4
TAPS = [0, 2]


def _prefilled(runner, prompts):
    caches = []
    for prompt in prompts:
        cache = runner.make_cache()
        runner(mx.array([prompt]), cache)
        caches.append(cache)
    return caches


def _random_case(seed, n):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    blocks = [[rng.randrange(256) for _ in range(rng.randint(2, 16))] for _ in range(n)]
    return prompts, blocks


@pytest.fixture(params=["hybrid", "plain"])
def runner(request, hybrid_target, plain_target):
    _, model = hybrid_target if request.param == "hybrid" else plain_target
    return TargetRunner(model)


@pytest.fixture(params=["step states kept", "replayed"])
def state_path(request, monkeypatch):
    """The CPU verify pass keeps every Gated DeltaNet step's state; above a memory bound (and on
    Metal) it keeps only the last, and a padded sequence's own state is replayed instead."""
    if request.param == "replayed":
        monkeypatch.setattr(target_module, "MAX_KEPT_STATE_BYTES", 0)
    return request.param


@pytest.mark.parametrize("seed", range(4))
def test_each_sequence_gets_its_solo_logits_features_and_cache(runner, state_path, seed):
    prompts, blocks = _random_case(seed, n=2 + seed % 3)
    record = "gdn" in runner.kinds
    solo_caches, batch_caches = _prefilled(runner, prompts), _prefilled(runner, prompts)
    solo = [verify_one(runner, VerifyRequest(mx.array([b]), c, TAPS, record)) for b, c in zip(blocks, solo_caches)]
    batched = verify_batch(
        runner, [VerifyRequest(mx.array([b]), c, TAPS, record) for b, c in zip(blocks, batch_caches)]
    )
    for block, s, b, solo_cache, batch_cache in zip(blocks, solo, batched, solo_caches, batch_caches):
        assert b.logits.shape == s.logits.shape == (1, len(block), tiny.VOCAB)
        assert b.features.shape == s.features.shape
        np.testing.assert_allclose(np.array(b.logits), np.array(s.logits), atol=ATOL)
        np.testing.assert_allclose(np.array(b.features), np.array(s.features), atol=ATOL)
        assert mx.array_equal(mx.argmax(b.logits, -1), mx.argmax(s.logits, -1))
        _assert_caches_equal(batch_cache, solo_cache, atol=ATOL)
        assert (b.recorded is None) == (not record)


@pytest.mark.parametrize("seed", range(6))
def test_rollback_after_a_batched_pass_equals_solo_rollback(runner, state_path, seed):
    """Each sequence keeps its own number of rows (any of 1..b, the whole block included)."""
    prompts, blocks = _random_case(100 + seed, n=3)
    rng = random.Random(seed)
    keeps = [rng.randint(1, len(b)) for b in blocks]
    keeps[seed % 3] = len(blocks[seed % 3])  # one sequence accepts its whole block: no rollback
    record = "gdn" in runner.kinds
    solo_caches, batch_caches = _prefilled(runner, prompts), _prefilled(runner, prompts)
    batched = verify_batch(
        runner, [VerifyRequest(mx.array([b]), c, TAPS, record) for b, c in zip(blocks, batch_caches)]
    )
    for block, keep, result, solo_cache, batch_cache in zip(blocks, keeps, batched, solo_caches, batch_caches):
        solo = verify_one(runner, VerifyRequest(mx.array([block]), solo_cache, TAPS, record))
        solo_cache.rollback(solo.recorded or [], fed=len(block), keep=keep)
        batch_cache.rollback(result.recorded or [], fed=len(block), keep=keep)
        _assert_caches_equal(batch_cache, solo_cache, atol=ATOL)
        # and the future is the same
        nxt = mx.array([[17, 4]])
        a, _ = runner(nxt, batch_cache)
        b, _ = runner(nxt, solo_cache)
        np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL)


def _oracle(cfg, continuation, corrupt, seed=1):
    dcfg = tiny.drafter_config(cfg, version=2, block_size=16, taps=TAPS)
    drafter = tiny.OracleDrafter(dcfg, continuation, corrupt)
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg, seed=seed).parameters()))
    return drafter


def _forcing(prompt_len, block, total):
    """Corrupted positions that make cycle after cycle accept 0, 1, .., block-1 drafts, then again."""
    accepts, pos, a = [], prompt_len, 0
    while pos < prompt_len + total:
        accepts.append(a)
        pos, a = pos + a + 1, (a + 1) % block
    return tiny.corrupted_for(prompt_len, accepts, block)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hybrid", "plain"])
def test_every_sequence_decodes_its_solo_greedy_output_under_batched_verify(kind, hybrid_target, plain_target):
    """Four sequences at once: different prompt lengths, block sizes and lengths (so the batch
    shrinks as they finish and the last cycles are shorter), every accepted count forced."""
    cfg, model = hybrid_target if kind == "hybrid" else plain_target
    runner = TargetRunner(model)
    rng = random.Random(kind)
    setups = []
    for prompt_len, block, max_tokens in ((3, 8, 60), (29, 5, 45), (11, 16, 140), (52, 3, 30)):
        prompt = [rng.randrange(256) for _ in range(prompt_len)]
        plain = [
            t
            for e in generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=max_tokens))
            for t in e.tokens
        ]
        settings = GenerationSettings(max_tokens=max_tokens, block_size=block)
        setups.append((prompt, plain, settings, _forcing(prompt_len, block, max_tokens)))
    solo = []
    for prompt, plain, settings, corrupt in setups:
        drafter = _oracle(cfg, prompt + plain, corrupt)
        solo.append([t for e in generate_speculative(runner, drafter, prompt, settings) for t in e.tokens])
        assert solo[-1] == plain
    loops = [
        speculative_steps(runner, _oracle(cfg, prompt + plain, corrupt), prompt, settings)
        for prompt, plain, settings, corrupt in setups
    ]
    tokens, accepted = defaultdict(list), defaultdict(set)
    for i, event in run_together(runner, loops, batch=True):
        tokens[i] += event.tokens
        if event.accepted is not None:
            accepted[i].add(event.accepted)
    for i, (_, plain, settings, _) in enumerate(setups):
        assert tokens[i] == solo[i]
        assert accepted[i] == set(range(settings.block_size)), f"sequence {i} saw accepted counts {sorted(accepted[i])}"


def test_a_batch_really_is_one_target_pass(hybrid_target):
    """step_together answers all the loops' verify requests with one runner call."""
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    calls = []

    class Counting(TargetRunner):
        def __call__(self, tokens, cache, *args, **kwargs):
            calls.append(tokens.shape)
            return super().__call__(tokens, cache, *args, **kwargs)

    counting = Counting(model)
    prompts = [[5, 6, 7], [1] * 20, [9, 8]]
    loops = [
        speculative_steps(runner, _oracle(cfg, p, set()), p, GenerationSettings(max_tokens=20, block_size=4))
        for p in prompts
    ]
    first = step_together(counting, loops)  # prefill and the first token: no verify yet
    assert all(s.event is not None and s.event.accepted is None for s in first)
    calls.clear()
    second = step_together(counting, loops)
    assert calls == [(3, 4)]
    assert all(s.event.accepted is not None for s in second)


def test_requests_of_different_drafters_are_refused(hybrid_target):
    _, model = hybrid_target
    runner = TargetRunner(model)
    a, b = _prefilled(runner, [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="same taps"):
        verify_batch(
            runner,
            [VerifyRequest(mx.array([[1, 2]]), a, [0, 2], True), VerifyRequest(mx.array([[1, 2]]), b, [1], True)],
        )


def test_a_second_verify_request_within_a_step_is_answered_alone(hybrid_target):
    """A loop may launch its next cycle's verify before its event (as after a plain step): the
    step answers that one with its own pass and still ends at the loop's event."""
    _, model = hybrid_target
    runner = TargetRunner(model)
    caches = _prefilled(runner, [[1, 2, 3], [4, 5, 6, 7]])
    answered = []

    def loop(cache, extra):
        for _ in range(2):
            result = yield VerifyRequest(mx.array([[9, 8, 7]]), cache, TAPS, True)
            answered.append(result.logits.shape)
            if extra:
                ahead = yield VerifyRequest(mx.array([[5]]), cache, TAPS, True)
                answered.append(ahead.logits.shape)
            yield "event"

    steps = step_together(runner, [loop(caches[0], True), loop(caches[1], False)])
    assert [s.event for s in steps] == ["event", "event"]
    assert sorted(answered) == [(1, 1, tiny.VOCAB), (1, 3, tiny.VOCAB), (1, 3, tiny.VOCAB)]
    assert caches[0].offset == 3 + 3 + 1 and caches[1].offset == 4 + 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hybrid", "plain"])
def test_sampling_under_batched_verify_draws_what_taking_turns_draws(kind, hybrid_target, plain_target):
    """Sampled decoding: lock-step decoding with batched verify passes gives every sequence the
    tokens that one pass each gives, and those are its plain sampled decoding's with its seed
    (each draw is keyed by the sequence's seed and position, and the target's distributions are
    the solo passes'), so batching keeps each sequence's exact sampling distribution. Unseeded
    sequences draw their keys from the global random state as they start."""
    from dflash2_mlx.decoding.sampling import SamplingSettings

    cfg, model = hybrid_target if kind == "hybrid" else plain_target
    runner = TargetRunner(model)
    dcfg = tiny.drafter_config(cfg, version=2, block_size=8, taps=TAPS)
    drafter = tiny.build_drafter(dcfg)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6] * 4, [5, 3]]
    settings = [
        GenerationSettings(max_tokens=n, block_size=b, sampling=SamplingSettings(temperature=0.9, top_p=0.9), seed=seed)
        for n, b, seed in ((30, 4, 7), (22, 6, None), (26, 3, 2**64 - 1))
    ]
    outputs = {}
    for batch in (True, False):
        mx.random.seed(11)  # the unseeded sequence's key
        tokens = defaultdict(list)
        loops = [speculative_steps(runner, drafter, p, s) for p, s in zip(prompts, settings)]
        for i, event in run_together(runner, loops, batch=batch):
            tokens[i] += event.tokens
        outputs[batch] = dict(tokens)
    assert outputs[True] == outputs[False]
    assert all(len(outputs[True][i]) == s.max_tokens for i, s in enumerate(settings))
    for i in (0, 2):
        plain = generate_autoregressive(runner, prompts[i], settings[i])
        assert [t for e in plain for t in e.tokens] == outputs[True][i]


def test_a_plain_step_batches_with_blocks(hybrid_target):
    """A one-row pass that records nothing (a plain step between speculative cycles) in the same
    batch as blocks that record: every cache still ends as its own pass leaves it."""
    _, model = hybrid_target
    runner = TargetRunner(model)
    prompts, blocks, records = [[1, 2, 3], [4] * 30, [7, 7]], [[5], [6, 1, 2, 3, 4, 5], [9, 9, 9]], [False, True, True]
    solo_caches, batch_caches = _prefilled(runner, prompts), _prefilled(runner, prompts)
    batched = verify_batch(
        runner, [VerifyRequest(mx.array([b]), c, TAPS, r) for b, c, r in zip(blocks, batch_caches, records)]
    )
    for block, record, result, solo_cache, batch_cache in zip(blocks, records, batched, solo_caches, batch_caches):
        solo = verify_one(runner, VerifyRequest(mx.array([block]), solo_cache, TAPS, record))
        assert (result.recorded is None) == (solo.recorded is None) == (not record)
        np.testing.assert_allclose(np.array(result.logits), np.array(solo.logits), atol=ATOL)
        _assert_caches_equal(batch_cache, solo_cache, atol=ATOL)
