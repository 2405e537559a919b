"""The scheduler's turn order, and the engine property it relies on: generations stepped in any
interleaving on one thread (sharing a prefix cache) give exactly their solo outputs."""

from __future__ import annotations

import random

import pytest
import tiny

from dflash2_mlx.caches.prefix import PrefixCache
from dflash2_mlx.engine import GenerationSettings, generate_autoregressive, generate_speculative
from dflash2_mlx.models.target import TargetRunner
from dflash2_mlx.server.scheduler import RoundRobin


def test_a_newcomer_takes_the_next_step_then_everyone_takes_turns():
    rr = RoundRobin(max_active=3)
    rr.add("long")
    order = []
    for step in range(7):
        if step == 2:
            rr.add("short")
        if step == 3:
            rr.add("third")
        (r,) = rr.next_group()
        order.append(r)
        rr.requeue(r)
    assert order == ["long", "long", "short", "third", "long", "short", "third"]
    assert not rr.has_room()
    with pytest.raises(RuntimeError):
        rr.add("fourth")


def test_a_group_is_the_requests_due_next_and_finished_ones_leave():
    rr = RoundRobin(max_active=4)
    for name in "abcd":
        rr.add(name)
    group = rr.next_group(3)
    assert group == ["a", "b", "c"] and len(rr) == 4  # handed out, still active
    rr.finished("b")
    rr.requeue("a")
    rr.requeue("c")
    assert rr.next_group(4) == ["d", "a", "c"] and len(rr) == 3 and rr.has_room()
    assert sorted(rr.active()) == ["a", "c", "d"]
    with pytest.raises(ValueError):
        RoundRobin(0)


@pytest.fixture(scope="module")
def pair(hybrid_target):
    cfg, model = hybrid_target
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8, sliding_window=6))
    return TargetRunner(model), drafter


def _generation(pair, prompt, max_tokens, speculative, cache=None, yield_during_prefill=False):
    runner, drafter = pair
    settings = GenerationSettings(max_tokens=max_tokens, prefill_step_size=4, yield_during_prefill=yield_during_prefill)
    if speculative:
        return generate_speculative(runner, drafter, prompt, settings, prefix_cache=cache, save_at=[3])
    return generate_autoregressive(runner, prompt, settings, prefix_cache=cache, save_at=[3])


def _tokens(events):
    return [t for e in events for t in e.tokens]


@pytest.mark.parametrize("seed", range(3))
def test_interleaved_generations_with_a_shared_prefix_cache_equal_their_solo_runs(pair, seed):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 200) for _ in range(5)]  # requests share a prefix: the cache is used mid-flight
    specs = [
        (
            shared + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 12))],
            rng.randrange(3, 20),
            rng.random() < 0.7,
        )
        for _ in range(4)
    ]
    solo = [_tokens(_generation(pair, p, n, spec)) for p, n, spec in specs]
    cache = PrefixCache()
    running = {
        i: _generation(pair, p, n, spec, cache, yield_during_prefill=True) for i, (p, n, spec) in enumerate(specs)
    }
    got = {i: [] for i in running}
    pauses = 0
    while running:
        i = rng.choice(sorted(running))  # any interleaving, one step at a time
        try:
            event = next(running[i])
        except StopIteration:
            del running[i]
            continue
        pauses += not event.tokens and event.stats is None
        got[i] += event.tokens
    assert [got[i] for i in range(len(specs))] == solo
    assert pauses > 0  # prompts longer than a chunk paused between chunks
    assert cache.hits > 0  # later prompts restored the shared prefix while others were decoding
