"""The persistent prompt cache (dflash2_mlx.caches.disk): exact restores after a "restart" (a new
cache object on the same directory), damaged and left-over files, the byte budget, identities,
bf16 arrays and several processes writing one directory."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
import tiny

from dflash2_mlx.caches.disk import FORMAT, DiskPrefixCache, _read_index
from dflash2_mlx.caches.prefix import PrefixCache, PrefixEntry
from dflash2_mlx.caches.target import CacheSnapshot
from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models.target import TargetRunner

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
BOUNDARY = 6


def _run(gen):
    events = list(gen)
    return [t for e in events for t in e.tokens], events[-1].stats


@pytest.fixture(scope="module")
def pair(hybrid_target):
    cfg, model = hybrid_target
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8, sliding_window=6))
    return TargetRunner(model), drafter


def _generate(pair, prompt, cache=None, speculative=True, save_at=()):
    runner, drafter = pair
    settings = GenerationSettings(max_tokens=12, prefill_step_size=5)
    if speculative:
        return _run(generate_speculative(runner, drafter, prompt, settings, prefix_cache=cache, save_at=save_at))
    return _run(generate_autoregressive(runner, prompt, settings, prefix_cache=cache, save_at=save_at))


def _disk(root: Path, identity: str = "pair-a", max_bytes: int = 2**30) -> DiskPrefixCache:
    return DiskPrefixCache(root, identity, max_bytes)


def _consistent(root: Path) -> dict:
    """The index parses, every entry's file exists with its checksum, and no file is unaccounted for."""
    import hashlib

    entries = _read_index(root / "index.json")
    files = {p.name for p in (root / "snapshots").iterdir()}
    assert files == {e["file"] for e in entries.values()}, (files, entries)
    for e in entries.values():
        data = (root / "snapshots" / e["file"]).read_bytes()
        assert len(data) == e["bytes"] and hashlib.sha256(data).hexdigest() == e["sha256"]
    return entries


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [True, False])
def test_a_restart_restores_the_prefix_from_disk_and_the_output_is_unchanged(pair, tmp_path, speculative):
    reference, _ = _generate(pair, PROMPT, speculative=speculative)
    first = PrefixCache(disk=_disk(tmp_path))
    out, stats = _generate(pair, PROMPT, first, speculative, save_at=[BOUNDARY])
    assert out == reference and stats.cached_tokens == 0
    assert first.disk.flush()
    # a new process: nothing in memory, the same directory
    restarted = PrefixCache(disk=_disk(tmp_path))
    again, stats = _generate(pair, PROMPT, restarted, speculative)
    assert again == reference
    assert stats.cached_tokens == len(PROMPT)  # the end-of-prompt snapshot, logits included
    assert restarted.disk_hits == 1
    # a prompt sharing only the first message restores the boundary snapshot
    edited = PROMPT[:BOUNDARY] + [40, 41, 42]
    fresh = PrefixCache(disk=_disk(tmp_path))
    out, stats = _generate(pair, edited, fresh, speculative)
    assert stats.cached_tokens == BOUNDARY and out == _generate(pair, edited, speculative=speculative)[0]
    assert fresh.disk.flush()
    _consistent(tmp_path)


def test_a_damaged_snapshot_is_ignored_with_a_warning_and_removed(pair, tmp_path, caplog):
    reference, _ = _generate(pair, PROMPT)
    cache = PrefixCache(disk=_disk(tmp_path))
    _generate(pair, PROMPT, cache)
    assert cache.disk.flush()
    entries = _read_index(tmp_path / "index.json")
    whole = next(e for e in entries.values() if e["tokens"] == len(PROMPT))
    path = tmp_path / "snapshots" / whole["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the tensors
    path.write_bytes(bytes(data))
    restarted = PrefixCache(disk=_disk(tmp_path))
    with caplog.at_level(logging.WARNING, logger="dflash2_mlx.prompt_cache"):
        out, stats = _generate(pair, PROMPT, restarted)
    assert out == reference
    assert stats.cached_tokens < len(PROMPT)  # not the damaged one
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warnings) == 1 and whole["file"] in warnings[0] and "\n" not in warnings[0]
    assert restarted.disk.flush()
    _consistent(tmp_path)  # the damaged file is gone: this run wrote a sound one in its place
    out, stats = _generate(pair, PROMPT, PrefixCache(disk=_disk(tmp_path)))
    assert out == reference and stats.cached_tokens == len(PROMPT)


def test_what_a_killed_writer_leaves_behind_is_cleaned_and_never_used(pair, tmp_path):
    cache = PrefixCache(disk=_disk(tmp_path))
    _generate(pair, PROMPT, cache, save_at=[BOUNDARY])
    assert cache.disk.flush()
    snaps = tmp_path / "snapshots"
    good = _read_index(tmp_path / "index.json")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    (snaps / f".{'a' * 64}.{pid}.tmp").write_bytes(b"half a safetensors fi")  # killed while writing
    (snaps / f"{'b' * 64}.safetensors").write_bytes(b"renamed, index not yet updated")  # killed after the rename
    (tmp_path / f".index.{pid}.tmp").write_text('{"format": "dflash2-mlx-pre')  # killed writing the index
    live = snaps / f".{'c' * 64}.{os.getpid()}.tmp"  # another live process is writing this one: keep it
    live.write_bytes(b"in progress")
    gone = next(e for e in good.values() if e["tokens"] == BOUNDARY)
    (snaps / gone["file"]).unlink()  # an index entry whose file vanished
    _disk(tmp_path)  # the next process to open the directory
    assert sorted(p.name for p in snaps.iterdir()) == sorted(
        [e["file"] for e in good.values() if e is not gone] + [live.name]
    )
    live.unlink()
    entries = _consistent(tmp_path)
    assert gone["file"] not in {e["file"] for e in entries.values()}
    # a garbage index: a warning, an empty cache, and the orphaned files go
    (tmp_path / "index.json").write_text("{not json")
    fresh = _disk(tmp_path)
    assert len(fresh) == 0 and _consistent(tmp_path) == {} and not list(snaps.iterdir())
    out, _ = _generate(pair, PROMPT, PrefixCache(disk=fresh))
    assert out == _generate(pair, PROMPT)[0]


def test_the_directory_stays_under_its_byte_budget_least_recently_used_first(pair, tmp_path):
    probe = PrefixCache(disk=_disk(tmp_path / "probe"))
    _generate(pair, [0] + PROMPT[1:], probe)
    assert probe.disk.flush()
    per_request = probe.disk.nbytes
    disk = _disk(tmp_path / "small", max_bytes=int(2.5 * per_request))
    for start in range(5):
        _generate(pair, [start] + PROMPT[1:], PrefixCache(disk=disk))
        assert disk.flush()
        assert disk.nbytes <= disk.max_bytes
    entries = _consistent(tmp_path / "small")
    kept = sorted(entries.values(), key=lambda e: e["last_use"])
    assert len(kept) >= 2
    restarted = PrefixCache(disk=_disk(tmp_path / "small", max_bytes=disk.max_bytes))
    assert _generate(pair, [4] + PROMPT[1:], restarted)[1].cached_tokens > 0  # the newest stayed
    assert _generate(pair, [0] + PROMPT[1:], PrefixCache(disk=restarted.disk))[1].cached_tokens == 0  # the oldest went


def test_another_model_pair_never_restores_these_snapshots(pair, tmp_path):
    cache = PrefixCache(disk=_disk(tmp_path, identity="pair-a"))
    _generate(pair, PROMPT, cache)
    assert cache.disk.flush()
    other = PrefixCache(disk=_disk(tmp_path, identity="pair-b"))
    assert _generate(pair, PROMPT, other)[1].cached_tokens == 0
    assert other.disk.flush()
    assert len(other.disk) > 0  # its own snapshots now sit beside the first pair's
    assert len(_read_index(tmp_path / "index.json")) == len(cache.disk) + len(other.disk)


def test_a_snapshot_larger_than_the_memory_budget_is_logged_and_kept_on_disk(pair, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dflash2_mlx.caches.prefix"):
        memory_only = PrefixCache(max_bytes=1)
        _generate(pair, PROMPT, memory_only)
        tiered = PrefixCache(max_bytes=1, disk=_disk(tmp_path))
        _generate(pair, PROMPT, tiered)
    messages = [r.getMessage() for r in caplog.records]
    assert any("larger than the in-memory budget" in m and "not stored" in m for m in messages)
    assert any("kept on disk only" in m for m in messages)
    assert memory_only.too_large > 0 and len(memory_only) == 0
    assert tiered.disk.flush()
    restarted = PrefixCache(max_bytes=1, disk=_disk(tmp_path))
    out, stats = _generate(pair, PROMPT, restarted)
    assert stats.cached_tokens == len(PROMPT) and out == _generate(pair, PROMPT)[0]


def test_bfloat16_arrays_come_back_bit_for_bit(tmp_path):
    keys = mx.random.normal((1, 2, 5, 4)).astype(mx.bfloat16)
    state = mx.random.normal((1, 2, 3, 3))
    entry = PrefixEntry(
        (1, 2, 3, 4, 5),
        CacheSnapshot([(keys, keys * 2, 5), (state[:, :, :2], state)], 5),
        None,
        mx.random.normal((1, 7)).astype(mx.float16),
    )
    disk = _disk(tmp_path)
    assert disk.store(entry) and disk.flush()
    back = _disk(tmp_path).lookup([1, 2, 3, 4, 5, 6], need_context=False)
    assert back is not None and back.tokens == entry.tokens
    (k, v, offset), (conv, st) = back.target.states
    assert k.dtype == mx.bfloat16 and mx.array_equal(k, keys) and mx.array_equal(v, keys * 2) and offset == 5
    assert mx.array_equal(conv, state[:, :, :2]) and mx.array_equal(st, state)
    assert back.last_logits is None or back.last_logits.dtype == mx.float16
    assert not disk.store(entry)  # stored already: not written twice


WRITER = textwrap.dedent("""
    import sys
    import mlx.core as mx
    from dflash2_mlx.caches.target import CacheSnapshot
    from dflash2_mlx.caches.disk import DiskPrefixCache
    from dflash2_mlx.caches.prefix import PrefixEntry

    root, me, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    disk = DiskPrefixCache(root, "shared-pair", budget)
    for i in range(40):
        kv = mx.full((1, 2, 64, 16), float(me * 1000 + i))
        entry = PrefixEntry(tuple([me, i] + [7] * 62), CacheSnapshot([(kv, kv, 64)], 64), None, None)
        while not disk.store(entry):
            disk.flush()
    assert disk.flush(120)
""")


@pytest.mark.slow
def test_two_processes_writing_one_directory_leave_it_consistent(tmp_path):
    one_entry = 2 * 2 * 64 * 16 * 4
    budget = 30 * one_entry  # fewer than the 80 written: eviction runs while both write
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(me), str(budget)], stderr=subprocess.PIPE, text=True
        )
        for me in (1, 2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "Traceback" not in err and "unreadable" not in err, err
    entries = _consistent(tmp_path)
    assert 0 < len(entries) and sum(e["bytes"] for e in entries.values()) <= budget
    disk = DiskPrefixCache(tmp_path, "shared-pair", budget)
    for e in entries.values():
        assert e["identity"] == disk.identity and e["tokens"] == 64
    survivors = [k for k in entries]
    assert survivors  # and each one reads back as exactly what its writer stored
    for me in (1, 2):
        for i in range(40):
            hit = disk.lookup([me, i] + [7] * 62 + [0], need_context=False)
            if hit is not None:
                k = hit.target.states[0][0]
                assert k.shape == (1, 2, 64, 16) and float(k[0, 0, 0, 0]) == me * 1000 + i
    assert json.loads((tmp_path / "index.json").read_text())["format"] == FORMAT


def test_the_directory_never_holds_more_than_the_budget_while_a_snapshot_is_written(tmp_path, monkeypatch):
    """Eviction happens before the new file is published: sampled at the moment of publication,
    the snapshots on disk are within the budget."""
    import os

    import numpy as np

    from dflash2_mlx.caches import disk as disk_mod

    root = tmp_path / "cache"
    cache = disk_mod.DiskPrefixCache(root, "identity", max_bytes=2500)
    seen = []
    real_replace = os.replace

    def replace_and_measure(src, dst):
        real_replace(src, dst)
        if str(dst).endswith(".safetensors"):
            seen.append(sum(f.stat().st_size for f in cache.snapshots.glob("*.safetensors")))

    monkeypatch.setattr(disk_mod.os, "replace", replace_and_measure)
    payload = {"x": np.zeros(200, dtype=np.float32)}  # ~0.9 KB per snapshot
    for i in range(6):
        cache._write(f"k{i}", payload, {"n": str(i)}, 10 + i, False, False)
    assert len(seen) == 6 and max(seen) <= 2500, seen
    big = {"x": np.zeros(2000, dtype=np.float32)}  # larger than the whole budget: not kept
    cache._write("big", big, {}, 99, False, False)
    assert not (cache.snapshots / "big.safetensors").exists()
    assert not list(cache.snapshots.glob("*.tmp"))
