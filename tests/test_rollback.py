"""After a verify pass and rollback, every cache equals the one plain decoding would have built."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
import tiny

from dflash2_mlx.models.target import TargetRunner

BLOCK = 8


def _assert_caches_equal(got, want, atol=1e-4):
    assert got.offset == want.offset
    for i, (kind, a, b) in enumerate(zip(got.kinds, got.layers, want.layers)):
        if kind == "attention":
            assert a.offset == b.offset, f"layer {i}: KV offset {a.offset} != {b.offset}"
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                np.testing.assert_allclose(
                    np.array(x[..., : a.offset, :]), np.array(y[..., : b.offset, :]), atol=atol, err_msg=f"layer {i} KV"
                )
        else:
            np.testing.assert_allclose(np.array(a[0]), np.array(b[0]), atol=atol, err_msg=f"layer {i} conv window")
            np.testing.assert_allclose(np.array(a[1]), np.array(b[1]), atol=atol, err_msg=f"layer {i} recurrent state")


@pytest.fixture(params=["keep", "replay", "replay-gpu-paths"])
def rollback(request, monkeypatch):
    """Each rollback path: kept per-step states (the CPU default), replay of the recorded inputs
    (Metal's), and replay with every GPU code path the CPU can take (the verify pass calls
    mlx-lm's gated_delta_update, as on Metal)."""
    from dflash2_mlx.backend import device
    from dflash2_mlx.caches import target as caches

    setting = request.param.split("-")[0]
    monkeypatch.setenv(caches.ROLLBACK_ENV, setting)
    if request.param.endswith("gpu-paths"):
        monkeypatch.setenv(device.PATHS_ENV, "gpu")
    return setting


@pytest.mark.parametrize("kind", ["hybrid", "plain"])
@pytest.mark.parametrize("accepted", range(BLOCK))
def test_rollback_after_a_verify_pass_matches_plain_feeding(kind, accepted, hybrid_target, plain_target, rollback):
    cfg, model = hybrid_target if kind == "hybrid" else plain_target
    runner = TargetRunner(model)
    assert runner.rollback_path() == (rollback if kind == "hybrid" else "trim")
    rng = random.Random(accepted)
    prompt = [rng.randrange(256) for _ in range(11)]
    block = [rng.randrange(256) for _ in range(BLOCK)]  # anchor + 7 drafts
    cache = runner.make_cache()
    runner(mx.array([prompt]), cache)
    recorded = []
    runner(mx.array([block]), cache, record=recorded)
    assert len(recorded) == runner.kinds.count("gdn")
    assert all((rec.states is not None) == (rollback == "keep") for rec in recorded)
    cache.rollback(recorded, fed=BLOCK, keep=accepted + 1)
    # the reference gets the prompt the same way, then the committed block tokens one by one,
    # as plain decoding would have fed them
    reference = runner.make_cache()
    runner(mx.array([prompt]), reference)
    for t in block[: accepted + 1]:
        runner(mx.array([[t]]), reference)
    _assert_caches_equal(cache, reference)
    # and the future is the same: the next token's logits agree
    nxt = mx.array([[17]])
    a, _ = runner(nxt, cache)
    b, _ = runner(nxt, reference)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def test_rollback_setting_rejects_an_unknown_value_in_one_line(monkeypatch):
    from dflash2_mlx.caches import target as caches

    monkeypatch.setenv(caches.ROLLBACK_ENV, "sometimes")
    with pytest.raises(ValueError, match="DFLASH2_MLX_ROLLBACK='sometimes' is not one of auto, keep, replay"):
        caches.rollback_setting()
    monkeypatch.setenv(caches.ROLLBACK_ENV, "")
    assert caches.rollback_setting() == "auto"


def test_auto_rollback_keeps_on_the_cpu_and_replays_on_the_gpu_paths(hybrid_target, monkeypatch):
    """auto: the CPU keeps per-step states (within the bound); where the recurrence is mlx-lm's
    (Metal, or the GPU paths forced on the CPU) rollback replays."""
    from dflash2_mlx.backend import device
    from dflash2_mlx.caches import target as caches

    monkeypatch.delenv(caches.ROLLBACK_ENV, raising=False)
    _, model = hybrid_target
    assert TargetRunner(model).rollback_path() == "keep"
    monkeypatch.setenv(device.PATHS_ENV, "gpu")
    assert TargetRunner(model).rollback_path() == "replay"


def test_a_27b_verify_pass_keeps_48_mib_per_layer_within_the_bound():
    """The numbers target.py's comment states: 16 rows x 48 value heads x 128 x 128 float32."""
    from types import SimpleNamespace

    from dflash2_mlx.models import target

    gdn = SimpleNamespace(num_v_heads=48, head_v_dim=128, head_k_dim=128)
    assert target.kept_state_bytes(gdn, 16) == 48 << 20
    assert 48 * target.kept_state_bytes(gdn, 16) == int(2.25 * 2**30)
    assert target.kept_state_bytes(gdn, 16) <= target.MAX_KEPT_STATE_BYTES


def test_snapshot_restores_the_whole_cache(hybrid_target):
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    cache = runner.make_cache()
    runner(mx.array([[1, 2, 3, 4, 5]]), cache)
    snap = cache.snapshot()
    before, _ = runner(mx.array([[9]]), cache)
    runner(mx.array([[10, 11, 12]]), cache)  # move on: later passes must not touch the snapshot
    cache.restore(snap)
    after, _ = runner(mx.array([[9]]), cache)
    assert mx.array_equal(before, after)
    assert snap.nbytes > 0


@pytest.mark.parametrize("window", [None, 6])
def test_drafter_context_cache_is_incremental(hybrid_target, window):
    """Feeding context rows cycle by cycle gives the K/V (and block output) of feeding them at once."""
    cfg, _ = hybrid_target
    dcfg = tiny.drafter_config(cfg, version=2, sliding_window=window)
    drafter = tiny.build_drafter(dcfg)
    taps = len(dcfg.target_layer_ids)
    features = mx.random.normal((1, 14, taps * dcfg.hidden_size))
    block = mx.random.normal((1, 8, dcfg.hidden_size))
    whole = drafter.make_cache()
    out_whole = drafter(block, features, whole)
    parts = drafter.make_cache()
    for lo, hi in ((0, 5), (5, 6), (6, 14)):
        out_parts = drafter(block, features[:, lo:hi], parts)
    assert parts.offset == whole.offset == 14
    for layer in range(dcfg.num_hidden_layers):
        keys, values, positions = parts.ordered(layer)
        whole_keys, whole_values, whole_positions = whole.ordered(layer)
        kept = 14 if window is None else window - 1  # the block's own K/V never enter
        assert positions.tolist() == whole_positions.tolist() == list(range(14 - kept, 14))
        np.testing.assert_allclose(np.array(keys), np.array(whole_keys), atol=1e-5)
        np.testing.assert_allclose(np.array(values), np.array(whole_values), atol=1e-5)
    np.testing.assert_allclose(np.array(out_parts), np.array(out_whole), atol=1e-5)


@pytest.mark.parametrize("tentative", [False, True])
@pytest.mark.parametrize("window", [None, 20])
def test_drafter_context_buffer_grows_and_wraps_without_changing_the_draft(hybrid_target, window, tentative):
    """Cycle-sized writes that grow the buffer past its first capacity (unbounded) or wrap the
    ring many times (window 20) leave the same visible rows, and the same block output, as
    feeding those rows to a fresh cache at once. Tentative writes (a verify pass's 8 rows, of
    which the accepted ones are kept, with the next block drafted before the commit, as the
    decode loop does) too."""
    cfg, _ = hybrid_target
    dcfg = tiny.drafter_config(cfg, version=2, sliding_window=window)
    drafter = tiny.build_drafter(dcfg)
    total = 300
    features = mx.random.normal((1, total + 8, len(dcfg.target_layer_ids) * dcfg.hidden_size))
    block = mx.random.normal((1, 8, dcfg.hidden_size))
    cycled = drafter.make_cache()
    pos, rng = 0, random.Random(0)
    while pos < total:
        n = min(rng.randint(1, 8), total - pos)
        if tentative:
            drafter.absorb(features[:, pos : pos + 8], cycled, valid=mx.array([n], dtype=mx.int32))
            out_cycled = drafter(block, None, cycled)
            cycled.commit(n)
        else:
            out_cycled = drafter(block, features[:, pos : pos + n], cycled)
        pos += n
    assert cycled.capacity == (512 if window is None else window - 1 + cycled.headroom)
    fresh = drafter.make_cache()
    first = 0 if window is None else total - (window - 1)
    fresh.skip(first)
    out_fresh = drafter(block, features[:, first:total], fresh)
    for layer in range(dcfg.num_hidden_layers):
        keys, values, positions = cycled.ordered(layer)
        seen = len(positions.tolist()) - (total - first)  # rows beyond the window stay in the ring
        fresh_keys, fresh_values, fresh_positions = fresh.ordered(layer)
        assert positions[seen:].tolist() == fresh_positions.tolist() == list(range(first, total))
        np.testing.assert_allclose(np.array(keys[:, :, seen:]), np.array(fresh_keys), atol=1e-5)
        np.testing.assert_allclose(np.array(values[:, :, seen:]), np.array(fresh_values), atol=1e-5)
    np.testing.assert_allclose(np.array(out_cycled), np.array(out_fresh), atol=1e-5)


def test_block_weight_copies_change_only_float_rounding_and_never_a_plain_step(hybrid_target):
    """With row-major weight copies (the CPU default), a block pass agrees with mlx-lm's within
    float rounding, and a one-row step (plain decoding) is still mlx-lm's bit for bit."""
    from mlx_lm.models.cache import make_prompt_cache

    from dflash2_mlx.backend import blas

    cfg, model = hybrid_target
    runner = TargetRunner(model, block_weight_copies=True)
    # float32 on the CPU: on by default, except with oneMKL (where views multiply as fast)
    assert TargetRunner(model).block_weight_copies == (blas.loaded != "mkl")
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 7]])
    ours, theirs = runner.make_cache(), make_prompt_cache(model)
    for i, chunk in enumerate((tokens[:, :1], tokens[:, 1:9], tokens[:, 9:10], tokens[:, 10:])):
        a, _ = runner(chunk, ours)
        b = model(chunk, cache=theirs)
        if i == 0:  # a plain step on identical inputs (later ones see the block pass's rounding)
            assert mx.array_equal(a, b)
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


@pytest.mark.parametrize("window,version", [(None, 2), (6, 2), (None, 1)])
def test_training_forward_sees_what_inference_sees(hybrid_target, window, version):
    """Many blocks in one training pass give each block the hidden rows inference would."""
    cfg, _ = hybrid_target
    dcfg = tiny.drafter_config(cfg, version=version, sliding_window=window, block_size=8)
    drafter = tiny.build_drafter(dcfg)
    taps = len(dcfg.target_layer_ids)
    features = mx.random.normal((1, 20, taps * dcfg.hidden_size))
    anchors = [0, 3, 11, 19]
    blocks = mx.random.normal((len(anchors), 8, dcfg.hidden_size))
    trained = drafter.train_forward(blocks, features, mx.array(anchors))
    for i, a in enumerate(anchors):
        cache = drafter.make_cache()
        inferred = drafter(blocks[i : i + 1], features[:, :a], cache)
        np.testing.assert_allclose(np.array(trained[i]), np.array(inferred[0]), atol=1e-5)


@pytest.mark.parametrize("steps", [1, 3, 8, 16])
def test_kept_step_states_are_mlx_lms_recurrence_bit_for_bit(steps):
    """The CPU verify pass keeps each step's state so rollback picks one instead of replaying:
    outputs and final state equal mlx-lm's gated_delta_update, and the state kept after step t
    equals running only the first t + 1 steps."""
    from mlx_lm.models.gated_delta import gated_delta_update

    from dflash2_mlx.models.target import gated_delta_with_states

    rng = np.random.default_rng(steps)
    Hk, Hv, Dk, Dv = 2, 4, 32, 16
    q, k = (mx.array(rng.normal(size=(1, steps, Hk, Dk)).astype(np.float32) * 0.2) for _ in range(2))
    v = mx.array(rng.normal(size=(1, steps, Hv, Dv)).astype(np.float32))
    a, b = (mx.array(rng.normal(size=(1, steps, Hv)).astype(np.float32)) for _ in range(2))
    A_log, dt_bias = (
        mx.array(rng.normal(size=(Hv,)).astype(np.float32)),
        mx.array(rng.normal(size=(Hv,)).astype(np.float32)),
    )
    state = mx.array(rng.normal(size=(1, Hv, Dv, Dk)).astype(np.float32))
    out, states = gated_delta_with_states(q, k, v, a, b, A_log, dt_bias, state)
    ref_out, ref_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    assert states.shape[1] == steps
    assert mx.array_equal(out, ref_out) and mx.array_equal(states[:, -1], ref_state)
    for t in range(steps):
        _, prefix_state = gated_delta_update(
            q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], a[:, : t + 1], b[:, : t + 1], A_log, dt_bias, state
        )
        assert mx.array_equal(states[:, t], prefix_state)


def test_a_target_updated_in_place_is_seen_by_the_compiled_head(hybrid_target):
    """The final norm and head run compiled with the head's transposed view as an input: a
    replaced head weight must change the logits of the next pass (no stale trace)."""
    _, model = hybrid_target
    runner = TargetRunner(model)
    head = runner.outer.lm_head
    h = mx.random.normal((1, 8, runner.hidden_size), key=mx.random.key(4))
    before, weight = runner._final_logits(h), head.weight
    try:
        head.weight = weight * 2
        after = runner._final_logits(h)
    finally:
        head.weight = weight
    np.testing.assert_allclose(np.array(after), 2 * np.array(before), rtol=1e-5, atol=1e-5)


def test_on_the_gpu_paths_the_walked_target_is_mlx_lms_forward_bit_for_bit(hybrid_target, monkeypatch):
    """With DFLASH2_MLX_PATHS=gpu the runner takes Metal's branches (mlx-lm's gated_delta_update
    in the compiled layer, RoPE and the causal mask as mlx-lm calls them, weight views): prefill,
    block-sized passes and one-row steps give mlx-lm's own logits exactly."""
    from mlx_lm.models.cache import make_prompt_cache

    from dflash2_mlx.backend import device

    monkeypatch.setenv(device.PATHS_ENV, "gpu")
    _, model = hybrid_target
    runner = TargetRunner(model)
    assert not runner.block_weight_copies
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3]])
    ours, theirs = runner.make_cache(), make_prompt_cache(model)
    for chunk in (tokens[:, :20], tokens[:, 20:21], tokens[:, 21:25], tokens[:, 25:]):
        if chunk.shape[1] == 0:
            continue
        a, _ = runner(chunk, ours, record=[])
        b = model(chunk, cache=theirs)
        assert mx.array_equal(a, b)
