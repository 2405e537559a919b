"""Slow work kept off the server's request path (issue 32, part 2): the block-size controller is
calibrated while the server loads, never inside a request's step; prompt-cache snapshots are
written by a background thread; slow scheduler turns can be traced with what ran in them."""

from __future__ import annotations

import fcntl
import gc
import logging

import mlx.core as mx

from dflash2_mlx.caches.disk import DiskPrefixCache
from dflash2_mlx.caches.prefix import PrefixEntry
from dflash2_mlx.caches.target import CacheSnapshot
from dflash2_mlx.policies.block_size import profile_for
from dflash2_mlx.server.stall_trace import DEFAULT_THRESHOLD, StallTrace, threshold_from_env
from dflash2_mlx.server.worker import Worker


def test_the_server_calibrates_its_cycle_costs_before_it_reports_ready_and_sampling_starts_from_them(embedded_pair):
    target, drafter = embedded_pair
    worker = Worker(str(target), str(drafter), max_concurrent=2, prefix_cache_bytes=0)
    worker.start()
    try:
        assert worker.ready.wait(300), worker.error
        profile = profile_for(worker.target.runner.model, worker.drafter)
        greedy, sampled = profile.cost_table(greedy=True), profile.cost_table(greedy=False)
        assert greedy.calibrated and sampled.calibrated  # no request's first step calibrates
        assert sampled.seconds == greedy.seconds and sampled.seconds is not greedy.seconds
    finally:
        worker.shutdown()
        worker.join(30)


def test_a_server_with_a_pinned_block_size_does_not_calibrate(embedded_pair):
    target, drafter = embedded_pair
    worker = Worker(str(target), str(drafter), prefix_cache_bytes=0, block_size=4)
    worker.start()
    try:
        assert worker.ready.wait(300), worker.error
        profile = profile_for(worker.target.runner.model, worker.drafter)
        assert not profile.cost_table(greedy=True).calibrated
    finally:
        worker.shutdown()
        worker.join(30)


def _entry(tokens: tuple[int, ...]) -> PrefixEntry:
    kv = mx.full((1, 2, len(tokens), 4), 1.5)
    return PrefixEntry(tokens, CacheSnapshot([(kv, kv, len(tokens))], len(tokens)), None, None)


def test_a_snapshot_store_returns_while_the_disk_is_held_up_and_the_file_appears_afterwards(tmp_path):
    """The directory lock is held (as by another process), so the writer cannot finish: ``store``
    must return anyway (decoding never waits for the disk), and the background thread writes the
    snapshot, in the usual format, once the lock is free."""
    disk = DiskPrefixCache(tmp_path, "pair", 2**30)
    entry = _entry((5, 6, 7))
    with open(tmp_path / "index.lock", "a") as other_process:  # flock: a second open file is another holder
        fcntl.flock(other_process, fcntl.LOCK_EX)
        try:
            assert disk.store(entry)  # returned although the writer is blocked on the lock
            assert not disk.contains(entry.tokens, context=False, logits=False)
        finally:
            fcntl.flock(other_process, fcntl.LOCK_UN)
    assert disk.flush(60)
    assert disk.contains(entry.tokens, context=False, logits=False)
    assert len(list((tmp_path / "snapshots").glob("*.safetensors"))) == 1
    back = DiskPrefixCache(tmp_path, "pair", 2**30).lookup([5, 6, 7, 8], need_context=False)
    assert back is not None and mx.array_equal(back.target.states[0][0], entry.target.states[0][0])


def test_the_stall_trace_is_off_unless_asked_and_reads_a_threshold_in_seconds():
    assert threshold_from_env("") is None
    assert threshold_from_env("off") is None
    assert threshold_from_env("1") == DEFAULT_THRESHOLD
    assert threshold_from_env("0.25") == 0.25
    assert threshold_from_env("0") == 0.0
    assert threshold_from_env("soon") is None


def test_a_turn_at_or_over_the_threshold_is_logged_with_what_ran_and_the_collectors_passes(caplog):
    trace = StallTrace(0.0)  # every turn counts as slow: nothing depends on the machine's speed
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2_mlx.server.stalls"):
            trace.begin()
            gc.collect()
            trace.end(["request r1 a cycle of 5 tokens", "request r2 a prefill chunk"])
    finally:
        trace.close()
    (record,) = [r for r in caplog.records if r.name == "dflash2_mlx.server.stalls"]
    message = record.getMessage()
    assert "request r1 a cycle of 5 tokens; request r2 a prefill chunk" in message
    assert "in 1 passes" in message
    assert trace.slow_turns == 1


def test_turns_are_not_timed_when_the_trace_is_off(caplog):
    trace = StallTrace(None)
    with caplog.at_level(logging.WARNING, logger="dflash2_mlx.server.stalls"):
        trace.begin()
        assert trace.end(["request r1 a cycle of 5 tokens"]) is None
    assert not caplog.records
    assert trace._on_gc not in gc.callbacks


def test_the_trace_names_each_request_and_its_kind_of_step():
    from dflash2_mlx.decoding.batched_verify import Step
    from dflash2_mlx.engine import GenerationEvent
    from dflash2_mlx.server.worker import Active, Job, _step_kind

    assert _step_kind(Step(event=GenerationEvent([4, 5, 6], "abc", accepted=2))) == "a cycle of 3 tokens"
    assert _step_kind(Step(event=GenerationEvent([], ""))) == "a prefill chunk"
    assert _step_kind(Step()) == "its last step"
    assert _step_kind(Step(error=ValueError("x"))) == "a failed step (ValueError)"
    job = Job("req_1", [1, 2], None, [], loop=None, deadline=0.0)
    first = Active(job, iter(()), 0.0, steps=1, last_step="a prefill chunk")
    assert Worker._describe(first, {"greedy"}) == (
        "request req_1 its first step (a prefill chunk; prefix-cache lookup "
        "and policy set-up; calibrated the pair's greedy cycle costs)"
    )
    later = Active(job, iter(()), 0.0, steps=5, last_step="a cycle of 3 tokens")
    assert Worker._describe(later, set()) == "request req_1 a cycle of 3 tokens"
