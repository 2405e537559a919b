"""Prefix caching, cancellation and logprobs: what chat and the server build on."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
import tiny

from dflash2_mlx.caches.prefix import PrefixCache
from dflash2_mlx.decoding.sampling import SamplingSettings
from dflash2_mlx.engine import GenerationSettings, generate_autoregressive, generate_speculative
from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.target import TargetRunner


def _run(gen):
    events = list(gen)
    return [t for e in events for t in e.tokens], events[-1]


@pytest.fixture(scope="module")
def pair(hybrid_target):
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8, sliding_window=6))
    return runner, drafter


@pytest.mark.parametrize("speculative", [True, False])
def test_a_later_turn_prefills_only_its_new_tokens(pair, speculative):
    runner, drafter = pair

    def gen(prompt, cache=None, save_at=()):
        settings = GenerationSettings(max_tokens=12, prefill_step_size=5)
        if speculative:
            return _run(generate_speculative(runner, drafter, prompt, settings, prefix_cache=cache, save_at=save_at))
        return _run(generate_autoregressive(runner, prompt, settings, prefix_cache=cache, save_at=save_at))

    cache = PrefixCache()
    turn1 = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    boundary = 6  # a message boundary inside the first prompt
    out1, last1 = gen(turn1, cache, save_at=[boundary])
    assert last1.stats.cached_tokens == 0
    turn2 = turn1 + out1 + [40, 41, 42]
    out2, last2 = gen(turn2, cache)
    # the end-of-answer snapshot covers turn 1 and all of its answer but the last token
    assert last2.stats.cached_tokens == len(turn1) + len(out1) - 1
    assert out2 == gen(turn2)[0]  # identical to a run without the cache
    # and again one turn later
    turn3 = turn2 + out2 + [50, 51]
    out4, last5 = gen(turn3, cache)
    assert last5.stats.cached_tokens == len(turn2) + len(out2) - 1
    assert out4 == gen(turn3)[0]
    # an edited later message still reuses the snapshot at the boundary
    edited = turn1[:boundary] + [99, 98, 97]
    out3, last3 = gen(edited, cache)
    assert last3.stats.cached_tokens == boundary and out3 == gen(edited)[0]
    # a turn whose answer was re-tokenized differently still reuses the end of its prompt
    retyped = turn1 + [out1[0] + 1] + [40, 41]
    out5, last6 = gen(retyped, cache)
    assert last6.stats.cached_tokens == len(turn1) and out5 == gen(retyped)[0]
    # the very same prompt again: nothing to prefill, same answer
    again, last4 = gen(turn1, cache)
    assert last4.stats.cached_tokens == len(turn1) and again == out1


def test_a_speculative_request_does_not_use_a_snapshot_without_drafter_context(pair):
    runner, drafter = pair
    cache = PrefixCache()
    prompt = [5, 6, 7, 8, 9, 10]
    settings = GenerationSettings(max_tokens=8)
    plain, _ = _run(generate_autoregressive(runner, prompt, settings, prefix_cache=cache))
    spec, last = _run(generate_speculative(runner, drafter, prompt + [1], settings, prefix_cache=cache))
    assert last.stats.cached_tokens == 0
    assert spec == _run(generate_speculative(runner, drafter, prompt + [1], settings))[0]


def test_prefix_cache_stays_under_its_byte_budget(pair):
    runner, drafter = pair
    cache = PrefixCache(max_bytes=1)
    _run(generate_speculative(runner, drafter, [1, 2, 3, 4], GenerationSettings(max_tokens=4), prefix_cache=cache))
    assert len(cache) == 0 and cache.nbytes == 0
    roomy = PrefixCache(max_bytes=10**9)
    _run(generate_speculative(runner, drafter, [0, 2, 3, 4], GenerationSettings(max_tokens=4), prefix_cache=roomy))
    per_request = roomy.nbytes
    small = PrefixCache(max_bytes=int(2.5 * per_request))
    for start in range(5):
        _run(
            generate_speculative(
                runner, drafter, [start, 2, 3, 4], GenerationSettings(max_tokens=4), prefix_cache=small
            )
        )
        assert small.nbytes <= small.max_bytes
    firsts = [k[0] for k in small._entries]
    assert 0 not in firsts and firsts[-1] == 4  # least recently used went first
    assert small.nbytes == sum(e.nbytes for e in small._entries.values())


@pytest.mark.parametrize("speculative", [True, False])
def test_cancel_stops_within_one_cycle(pair, speculative):
    runner, drafter = pair
    cancel = threading.Event()
    settings = GenerationSettings(max_tokens=200, cancel=cancel, block_size=4)
    gen = (
        generate_speculative(runner, drafter, [1, 2, 3], settings)
        if speculative
        else generate_autoregressive(runner, [1, 2, 3], settings)
    )
    events = []
    for event in gen:
        events.append(event)
        if len(events) == 2:
            cancel.set()
    assert len(events) == 3 and events[-1].finish_reason == "cancelled" and events[-1].tokens == []
    assert events[-1].stats.finish_reason == "cancelled"


def test_cancel_is_checked_between_prefill_chunks(pair):
    runner, drafter = pair
    cancel = threading.Event()

    class CountingRunner(TargetRunner):
        calls = 0

        def __call__(self, *args, **kwargs):
            CountingRunner.calls += 1
            cancel.set()  # set during the first chunk
            return super().__call__(*args, **kwargs)

    counting = CountingRunner(runner.model)
    settings = GenerationSettings(max_tokens=5, cancel=cancel, prefill_step_size=4)
    events = list(generate_speculative(counting, drafter, list(range(1, 30)), settings))
    assert CountingRunner.calls == 1  # 29 prompt tokens would take 8 chunks
    assert events[-1].finish_reason == "cancelled"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_whichever_decoder_emits_the_token(pair, temperature):
    runner, drafter = pair
    prompt = [3, 1, 4, 1, 5]
    settings = GenerationSettings(max_tokens=10, logprobs=3, sampling=SamplingSettings(temperature=temperature), seed=2)
    spec_events = list(generate_speculative(runner, drafter, prompt, settings))
    tokens = [t for e in spec_events for t in e.tokens]
    logprobs = [lp for e in spec_events for lp in (e.logprobs or [])]
    assert len(logprobs) == len(tokens)
    # recompute each token's log-probability by plain feeding
    cache = runner.make_cache()
    logits, _ = runner(mx.array([prompt]), cache)
    row = logits[0, -1]
    for token, (lp, alts) in zip(tokens, logprobs):
        ref = np.array(row - mx.logsumexp(row))
        assert lp == pytest.approx(float(ref[token]), abs=1e-4)
        assert len(alts) == 3 and alts[0][1] == pytest.approx(float(ref.max()), abs=1e-4)
        if temperature == 0:
            assert alts[0][0] == token
        logits, _ = runner(mx.array([[token]]), cache)
        row = logits[0, -1]


def test_profiled_decoding_emits_the_same_tokens_and_accounts_every_phase(pair):
    from dflash2_mlx.decoding.profiling import PHASES, CycleProfiler

    runner, drafter = pair
    prompt = [5, 9, 2, 7, 7, 1, 3]
    settings = GenerationSettings(max_tokens=30, block_size=4)  # pinned: auto may decode this random drafter plainly
    plain, _ = _run(generate_speculative(runner, drafter, prompt, settings))
    profiler = CycleProfiler()
    profiled, last = _run(
        generate_speculative(
            runner, drafter, prompt, GenerationSettings(max_tokens=30, block_size=4, profiler=profiler)
        )
    )
    assert profiled == plain
    report = profiler.as_dict()
    assert report["cycles"] == last.stats.verify_steps + last.stats.plain_steps
    assert set(report["shares"]) == set(PHASES) and sum(report["shares"].values()) == pytest.approx(1.0)
    for phase in ("draft", "select", "verify", "accept", "rollback"):
        assert report["ms"][phase] > 0, phase


class _RecordingDrafter(Drafter):
    """Records, for every block it drafts, whether the previous cycle's rows were still a
    tentative context write (its accepted count not yet read by the host)."""

    def __init__(self, config):
        super().__init__(config)
        self.drafted_ahead = []

    def __call__(self, block_embeds, features, cache):
        self.drafted_ahead.append(cache.tentative is not None)
        return super().__call__(block_embeds, features, cache)


def test_each_block_is_drafted_before_the_previous_cycles_host_sync(hybrid_target):
    """The loop drafts block k+1 while cycle k's verify pass computes, wherever block k+1's size
    cannot depend on cycle k's accepted count (all but the last blocks before max_tokens); the
    output is plain decoding's either way."""
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    drafter = _RecordingDrafter(tiny.drafter_config(cfg, version=2, block_size=8))
    mx.eval(drafter.parameters())
    prompt, max_tokens = [5, 6, 7, 8], 40
    events = list(
        generate_speculative(runner, drafter, prompt, GenerationSettings(max_tokens=max_tokens, block_size=8))
    )
    plain, _ = _run(generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=max_tokens)))
    assert [t for e in events for t in e.tokens] == plain
    emitted, expected = len(events[0].tokens), [False]  # the first block follows the prefill
    for event in events[1:]:
        block = min(8, max_tokens - emitted + 1)
        expected.append(max_tokens - (emitted + block) + 1 >= 8)
        emitted += len(event.tokens)
    assert drafter.drafted_ahead == expected[: len(drafter.drafted_ahead)]
    assert len(drafter.drafted_ahead) == len(events) - 1  # every drafted block was verified
    assert sum(drafter.drafted_ahead) >= 10
