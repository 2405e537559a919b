"""Kernels: the Metal bodies in metal/ (compiled for the CPU by tests/kernel_harness) against the
reference ops in dflash2_mlx.kernels.reference, the launch plans (kernels.plans), the self-check
(kernels.selfcheck) and the dispatcher (env var, override, active_kernels, the Mac self-check logic)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_harness import harness  # noqa: E402

from dflash2_mlx.kernels import dispatch as kernels  # noqa: E402
from dflash2_mlx.kernels import plans, reference, selfcheck  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _normal(rng, shape, dtype=mx.float32, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _conv_args(rng, n, length, hidden, groups, dtype=mx.float32, dyn_dtype=None, base_dtype=None):
    x = _normal(rng, (n, length, hidden), dtype)
    dyn = _normal(rng, (n, length, 2, groups), dyn_dtype or dtype, 0.5)
    base = _normal(rng, (2, hidden), base_dtype or dtype)
    return x, dyn, base


def _pair_args(rng, n, rows, k, rank, vocab, dtypes=None, cand_dtype=mx.int32):
    dtypes = dtypes or {}
    anchor = mx.array(rng.integers(0, vocab, size=(n,)).astype(np.int32))
    cand = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(n * rows)])
    cand = mx.array(cand.reshape(n, rows, k).astype(np.int32)).astype(cand_dtype)
    unary = _normal(rng, (n, rows, k), dtypes.get("unary", mx.float32))
    hidden = _normal(rng, (n, rows, rank), dtypes.get("hidden", mx.float32))
    scale = 1.0 / np.sqrt(rank)
    pred = _normal(rng, (vocab, rank), dtypes.get("codebook", mx.float32), np.sqrt(scale))
    succ = _normal(rng, (vocab, rank), dtypes.get("codebook", mx.float32), np.sqrt(scale))
    return [anchor, cand, unary, hidden, pred, succ]


def _pair_scores_numpy(args):
    """Reference pair scores in float64: [N, R, k(pred), k(cand)], row 0 at predecessor 0."""
    anchor, cand, unary, hidden, pred, succ = (
        np.array(a.astype(mx.float32)) if a.dtype in (mx.bfloat16, mx.float16) else np.array(a) for a in args
    )
    n, rows, k = cand.shape
    out = np.full((n, rows, k, k), np.nan)
    for b in range(n):
        for i in range(rows):
            preds = [anchor[b]] if i == 0 else list(cand[b, i - 1])
            for a, p in enumerate(preds):
                left = pred[p].astype(np.float64) * hidden[b, i].astype(np.float64)
                out[b, i, a] = unary[b, i] + succ[cand[b, i]].astype(np.float64) @ left
    return out


# ---------------------------------------------------------------------------------------------
# The harness itself
# ---------------------------------------------------------------------------------------------


def test_compiler_is_available():
    # Fails with a clear message (HarnessError) when g++ is missing: CI must install it.
    assert Path(harness.find_compiler()).exists()


def test_missing_compiler_is_a_clear_failure(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-dflash2")
    with pytest.raises(harness.HarnessError, match="apt-get install g\\+\\+"):
        harness.find_compiler()


CAST_SPEC = plans.KernelSpec(name="harness_cast", filename="<test>", input_names=("inp",), output_names=("out",))
CAST_BODY = """
  const uint i = thread_position_in_grid.x;
  out[i] = static_cast<T>(static_cast<float>(inp[i]));
"""


def _cast(a: mx.array, dtype: mx.Dtype) -> mx.array:
    plan = plans.Plan(
        kernel="harness_cast",
        inputs=[a],
        template=[("T", dtype)],
        grid=(a.size, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[a.shape],
        output_dtypes=[dtype],
        finish=lambda outs: outs[0],
    )
    return harness.run(plan, source=CAST_BODY, spec=CAST_SPEC)[0]


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_shim_16bit_conversions_round_like_mlx(dtype):
    rng = np.random.default_rng(1)
    specials = np.array(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            np.inf,
            -np.inf,
            65504.0,
            65519.99,
            65520.0,
            1e6,
            6.1e-5,
            6.0e-8,
            2.9e-8,
            3.0e-8,
            1e-45,
            -1e-45,
            1e-40,
            3.4e38,
        ],
        dtype=np.float32,
    )
    # Values exactly halfway between two 16-bit neighbours (ties go to even), and near-halfway.
    mant = rng.integers(0, 1 << 23, size=4096, dtype=np.uint32)
    exps = rng.integers(90, 160, size=4096, dtype=np.uint32)
    ties = (exps << 23) | (mant & ~np.uint32(0xFFFF)) | np.uint32(0x8000)
    ties_h = (exps << 23) | (mant & ~np.uint32(0x1FFF)) | np.uint32(0x1000)
    values = np.concatenate(
        [
            specials,
            ties.view(np.float32),
            ties_h.view(np.float32),
            (rng.standard_normal(20000) * np.exp2(rng.integers(-30, 20, 20000))).astype(np.float32),
        ]
    )
    x = mx.array(values)
    got, want = _cast(x, dtype), x.astype(dtype)
    assert np.array_equal(_bits(got), _bits(want))
    # and back to float32 exactly
    assert np.array_equal(np.array(_cast(want, mx.float32)), np.array(want.astype(mx.float32)))
    # NaN stays NaN (payload bits may differ between implementations)
    nan = _cast(mx.array(np.array([np.nan, -np.nan], np.float32)), dtype)
    assert np.all(np.isnan(np.array(nan.astype(mx.float32))))


def test_shim_rejects_half_arithmetic():
    # Conversions are explicit: a body computing in half instead of float must not compile.
    body = "const uint i = thread_position_in_grid.x; out[i] = inp[i] * inp[i];"
    a = mx.ones((16,), mx.float16)
    plan = plans.Plan(
        kernel="harness_cast",
        inputs=[a],
        template=[("T", mx.float16)],
        grid=(16, 1, 1),
        threadgroup=(16, 1, 1),
        output_shapes=[(16,)],
        output_dtypes=[mx.float16],
        finish=lambda outs: outs[0],
    )
    with pytest.raises(harness.HarnessError, match="compiling"):
        harness.run(plan, source=body, spec=CAST_SPEC)


def test_generated_signature_mirrors_mlx():
    spec = plans.KERNEL_SPECS["select_greedy"]
    body = plans.load_source(spec)
    rng = np.random.default_rng(0)
    args = _pair_args(rng, 2, 3, 4, 8, 50)
    plan = plans.plan_select_greedy(*args)
    text, _, uses_barrier = harness.generate(spec, body, plan.inputs, plan.output_dtypes, [])
    assert uses_barrier
    assert "void custom_kernel_dflash2_pair_greedy(" in text
    assert "const constant int32_t* anchor" in text  # 2 elements < 8: constant address space
    assert "const device int32_t* candidates" in text
    assert "const constant int* candidates_shape" in text
    assert "device float* scores" in text and "device int32_t* path" in text
    assert "uint3 threadgroup_position_in_grid" in text
    conv = plans.KERNEL_SPECS["two_tap_conv"]
    x = mx.zeros((1, 2, 16), mx.bfloat16)
    conv_plan = plans.plan_two_tap_conv(x, mx.zeros((1, 2, 2, 1)), mx.zeros((2, 16)))
    text, _, uses_barrier = harness.generate(
        conv,
        plans.load_source(conv),
        conv_plan.inputs,
        conv_plan.output_dtypes,
        conv_plan.template,
    )
    assert not uses_barrier
    assert "template <typename T>" in text
    assert "custom_kernel_dflash2_two_tap_conv__bfloat16_t<bfloat16_t>(" in text
    assert "const device bfloat16_t* x" in text and "device bfloat16_t* out" in text


# ---------------------------------------------------------------------------------------------
# Two-tap conv
# ---------------------------------------------------------------------------------------------

CONV_SHAPES = [  # (N, L, H, G): block sizes 2..16, odd group counts, several N
    (1, 2, 16, 1),
    (3, 3, 48, 3),
    (2, 4, 40, 5),
    (5, 5, 63, 7),
    (1, 6, 64, 16),
    (4, 7, 90, 9),
    (2, 8, 80, 5),
    (3, 9, 33, 11),
    (1, 10, 32, 2),
    (7, 11, 75, 15),
    (2, 12, 48, 3),
    (6, 13, 26, 13),
    (1, 14, 112, 7),
    (3, 15, 96, 3),
    (9, 16, 64, 1),
    (2, 16, 5120, 320),
    (1, 1, 32, 2),
    (2, 2, 2, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_matches_reference(dtype):
    rng = np.random.default_rng(2)
    for n, length, hidden, groups in CONV_SHAPES:
        args = _conv_args(rng, n, length, hidden, groups, dtype)
        got = harness.two_tap_conv(*args)
        problems = harness.compare_conv(got, *args)
        assert not problems, (n, length, hidden, groups, problems)
        # Same float32 arithmetic and one round-to-nearest-even: equal to the same-dtype
        # reference except (rarely) 1 unit in the last place.
        want = reference.reference_two_tap_conv(*args)
        g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        ulp = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
        assert np.all(np.abs(g - w) <= ulp * np.maximum(np.abs(w), 2.0**-14) + 1e-30)
        assert np.mean(g == w) >= 0.999


def test_conv_mixed_dtypes_and_noncontiguous_inputs():
    rng = np.random.default_rng(3)
    for xd, dd, bd in [
        (mx.bfloat16, mx.float32, mx.float32),
        (mx.float16, mx.bfloat16, mx.float32),
        (mx.float32, mx.bfloat16, mx.float16),
    ]:
        args = _conv_args(rng, 3, 8, 96, 3, xd, dd, bd)
        assert not harness.compare_conv(harness.two_tap_conv(*args), *args)
    # x given as a transposed view: ensure_row_contiguous copies it first
    xt = _normal(rng, (2, 64, 8)).transpose(0, 2, 1)
    dyn = _normal(rng, (2, 8, 2, 4))
    base = _normal(rng, (2, 64))
    assert not harness.compare_conv(harness.two_tap_conv(xt, dyn, base), xt, dyn, base)


def test_conv_never_crosses_a_block_boundary():
    rng = np.random.default_rng(4)
    x, dyn, base = _conv_args(rng, 3, 5, 32, 2)
    got = np.array(harness.two_tap_conv(x, dyn, base))
    first = np.array(reference.reference_two_tap_conv(x[1:2, :1], dyn[1:2, :1], base))
    np.testing.assert_array_equal(got[1:2, :1], first)  # row 0 of block 1 sees zeros before it


def test_unsupported_shapes_have_no_kernel_plan():
    x = mx.zeros((1, 4, 30))
    assert plans.plan_two_tap_conv(x, mx.zeros((1, 4, 2, 4)), mx.zeros((2, 30))) is None  # 30 % 4
    assert plans.plan_two_tap_conv(x.astype(mx.int32), mx.zeros((1, 4, 2, 3)), mx.zeros((2, 30))) is None
    rng = np.random.default_rng(21)
    pair = _pair_args(rng, 2, 3, 4, 8, 20)
    assert plans.plan_select_greedy(*pair) is not None
    bad = list(pair)
    bad[3] = mx.zeros((2, 3, 9))  # rank differs from the codebooks'
    assert plans.plan_select_greedy(*bad) is None


def test_conv_other_tap_counts_fall_back_to_reference():
    rng = np.random.default_rng(5)
    x = _normal(rng, (2, 6, 32))
    dyn = _normal(rng, (2, 6, 3, 4))
    base = _normal(rng, (3, 32))
    assert plans.plan_two_tap_conv(x, dyn, base) is None
    np.testing.assert_array_equal(
        np.array(harness.two_tap_conv(x, dyn, base)),
        np.array(reference.reference_two_tap_conv(x, dyn, base)),
    )


# ---------------------------------------------------------------------------------------------
# Pair scores: the greedy walk
# ---------------------------------------------------------------------------------------------

PAIR_SHAPES = [  # (N, R, k, r, V)
    (1, 1, 1, 1, 5),
    (1, 15, 16, 256, 1000),
    (3, 7, 16, 256, 1000),
    (9, 3, 5, 7, 50),
    (2, 15, 2, 33, 64),
    (8, 4, 16, 256, 1000),
    (4, 11, 9, 17, 200),
    (1, 2, 3, 4, 10),
]


@pytest.mark.parametrize("shape", PAIR_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_greedy_matches_reference(shape):
    rng = np.random.default_rng(6)
    args = _pair_args(rng, *shape)
    got = harness.select_greedy(*args)
    assert not harness.compare_paths(got, reference.reference_select_greedy(*args))
    # the kernel's pair-score scratch against float64 pair scores
    scores = np.array(harness.run_plan_outputs("select_greedy", *args)[1])
    want = _pair_scores_numpy(args)
    n, rows, k = shape[:3]
    valid = np.ones((n, rows, k, k), bool)
    valid[:, 0, 1:] = False  # row 0 has one predecessor (the anchor), stored at a = 0
    np.testing.assert_allclose(scores[valid], want[valid], rtol=1e-5, atol=1e-4)


def test_greedy_dtypes_and_uint32_candidates():
    rng = np.random.default_rng(7)
    dtypes = {"unary": mx.bfloat16, "hidden": mx.float16, "codebook": mx.bfloat16}
    args = _pair_args(rng, 3, 15, 16, 256, 1000, dtypes, cand_dtype=mx.uint32)
    got = harness.select_greedy(*args)
    assert got.dtype == mx.uint32
    assert not harness.compare_paths(got, reference.reference_select_greedy(*args))


def _tie_args(rng, n=4, rows=9, k=8, rank=6, vocab=40):
    """Small-integer data: every score is exact in any summation order, and ties abound."""
    args = _pair_args(rng, n, rows, k, rank, vocab)
    args[2] = mx.array(rng.integers(-1, 2, size=(n, rows, k)).astype(np.float32))
    args[3] = mx.array(rng.integers(-1, 2, size=(n, rows, rank)).astype(np.float32))
    args[4] = mx.array(rng.integers(-1, 2, size=(vocab, rank)).astype(np.float32))
    args[5] = mx.array(rng.integers(-1, 2, size=(vocab, rank)).astype(np.float32))
    return args


def test_greedy_ties_take_the_first_maximum():
    rng = np.random.default_rng(8)
    args = _tie_args(rng)
    want = reference.reference_select_greedy(*args)
    assert not harness.compare_paths(harness.select_greedy(*args), want)
    assert not harness.compare_paths(harness.run_kernel("select_greedy", *args, reverse=True), want)
    # zero pair term and all-equal unary: always the first candidate
    args[3] = mx.zeros_like(args[3])
    args[2] = mx.zeros_like(args[2])
    np.testing.assert_array_equal(np.array(harness.select_greedy(*args)), np.array(args[1][:, :, 0]))


# ---------------------------------------------------------------------------------------------
# The comparisons can fail: deliberately wrong kernels are caught
# ---------------------------------------------------------------------------------------------


def _mutate(name: str, old: str, new: str) -> str:
    body = plans.load_source(name)
    assert old in body, f"mutation anchor {old!r} not in {name}"
    return body.replace(old, new)


def test_wrong_conv_is_detected():
    rng = np.random.default_rng(11)
    args = _conv_args(rng, 2, 8, 48, 3)
    wrong = _mutate("two_tap_conv", "k1 * prev", "k1 * cur")
    got = harness.run_kernel("two_tap_conv", *args, source=wrong)
    assert harness.compare_conv(got, *args)
    # leaking the previous block's last row into the next block
    wrong = _mutate(
        "two_tap_conv",
        "float prev = 0.0f;",
        "float prev = n > 0 ? static_cast<float>(x[(size_t(n) * L - 1) * H + c]) : 0.0f;",
    )
    got = harness.run_kernel("two_tap_conv", *args, source=wrong)
    assert harness.compare_conv(got, *args)
    # bfloat16 truncation instead of round-to-nearest-even is beyond 1 ulp for some elements
    x, dyn, base = _conv_args(rng, 2, 8, 48, 3, mx.bfloat16)
    wrong = _mutate(
        "two_tap_conv",
        "static_cast<T>(k0 * cur + k1 * prev)",
        "static_cast<T>(k0 * cur + k1 * prev - 0.0039f * metal::abs(k0 * cur + k1 * prev))",
    )
    got = harness.run_kernel("two_tap_conv", x, dyn, base, source=wrong)
    assert (
        np.mean(
            np.array(got.astype(mx.float32))
            == np.array(reference.reference_two_tap_conv(x, dyn, base).astype(mx.float32))
        )
        < 0.999
    )


def test_out_of_bounds_write_is_detected():
    rng = np.random.default_rng(12)
    args = _conv_args(rng, 2, 4, 32, 2)
    wrong = _mutate("two_tap_conv", "out[xi] =", "out[xi + 1] =")
    with pytest.raises(harness.HarnessError, match="out-of-bounds"):
        harness.run_kernel("two_tap_conv", *args, source=wrong)


def test_wrong_greedy_tie_break_is_detected():
    rng = np.random.default_rng(13)
    args = _tie_args(rng)
    wrong = _mutate("select_greedy", "if (s > best)", "if (s >= best)")
    got = harness.run_kernel("select_greedy", *args, source=wrong)
    assert harness.compare_paths(got, reference.reference_select_greedy(*args))


def test_missing_barrier_is_detected():
    # Without the barrier, thread 0 walks before the other threads wrote their scores: the harness
    # runs threads in order, so the walk reads poison (NaN) and the path is wrong.
    rng = np.random.default_rng(14)
    args = _pair_args(rng, 2, 15, 16, 32, 100)
    wrong = _mutate("select_greedy", "threadgroup_barrier(mem_flags::mem_device);", "")
    got = harness.run_kernel("select_greedy", *args, source=wrong)
    assert harness.compare_paths(got, reference.reference_select_greedy(*args))
    # and with the barrier, the order of the threads does not matter
    want = reference.reference_select_greedy(*args)
    assert not harness.compare_paths(harness.run_kernel("select_greedy", *args, reverse=True), want)


def test_divergent_barrier_is_an_error():
    rng = np.random.default_rng(15)
    args = _pair_args(rng, 1, 3, 4, 8, 20)
    wrong = _mutate(
        "select_greedy",
        "threadgroup_barrier(mem_flags::mem_device);",
        "if (tid == 0) { threadgroup_barrier(mem_flags::mem_device); }",
    )
    with pytest.raises(harness.HarnessError, match="not reached by every thread"):
        harness.run_kernel("select_greedy", *args, source=wrong)


# ---------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------


def test_sources_load_from_the_package_metal_folder():
    for name, spec in plans.KERNEL_SPECS.items():
        assert plans.load_source(name) == (REPO / "dflash2_mlx" / "kernels" / "metal" / spec.filename).read_text()
    assert (
        REPO / "dflash2_mlx" / "kernels" / "metal" / "__init__.py"
    ).exists()  # package dflash2_mlx.kernels.metal (package data)


def test_reference_on_this_machine(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert not mx.metal.is_available()
    assert kernels.active_kernels() == {name: "reference" for name in reference.KERNEL_NAMES}
    rng = np.random.default_rng(17)
    args = _conv_args(rng, 2, 8, 48, 3)
    np.testing.assert_array_equal(
        np.array(kernels.two_tap_conv(*args)), np.array(reference.reference_two_tap_conv(*args))
    )
    pair = _pair_args(rng, 2, 5, 4, 8, 30)
    np.testing.assert_array_equal(
        np.array(kernels.select_greedy(*pair)), np.array(reference.reference_select_greedy(*pair))
    )


def test_override_routes_calls_and_restores():
    calls = []

    def fake_conv(x, dynamic, base):
        calls.append("conv")
        return x * 0 + 7

    def fake_greedy(*args):
        calls.append("greedy")
        return mx.zeros((1, 1), mx.int32)

    x = mx.ones((1, 2, 16))
    dyn, base = mx.zeros((1, 2, 2, 1)), mx.zeros((2, 16))
    with kernels.override(two_tap_conv=fake_conv):
        assert kernels.active_kernels()["two_tap_conv"] == "override"
        assert kernels.active_kernels()["select_greedy"] == "reference"
        assert float(kernels.two_tap_conv(x, dyn, base)[0, 0, 0]) == 7.0
        with kernels.override(select_greedy=fake_greedy):
            kernels.select_greedy(None, None, None, None, None, None)
            assert kernels.active_kernels()["select_greedy"] == "override"
            assert kernels.active_kernels()["two_tap_conv"] == "override"
        assert kernels.active_kernels()["select_greedy"] == "reference"
    assert calls == ["conv", "greedy"]
    assert kernels.active_kernels()["two_tap_conv"] == "reference"
    assert float(kernels.two_tap_conv(x, dyn, base)[0, 0, 0]) == 0.0
    with pytest.raises(ZeroDivisionError):
        with kernels.override(two_tap_conv=fake_conv):
            1 / 0
    assert kernels.active_kernels()["two_tap_conv"] == "reference"


def test_env_var_forces_reference(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert set(kernels.active_kernels().values()) == {"reference"}
    with kernels.override(select_greedy=lambda *a: None):
        assert kernels.active_kernels()["select_greedy"] == "override"  # tests still route


def test_public_functions_through_the_harness():
    rng = np.random.default_rng(18)
    conv = _conv_args(rng, 2, 16, 5120, 320, mx.bfloat16)
    pair = _pair_args(rng, 2, 15, 16, 256, 1000)
    with kernels.override(**harness.harness_kernels()):
        assert set(kernels.active_kernels().values()) == {"override"}
        got_conv = kernels.two_tap_conv(*conv)
        got_greedy = kernels.select_greedy(*pair)
    assert not harness.compare_conv(got_conv, *conv)
    assert not harness.compare_paths(got_greedy, reference.reference_select_greedy(*pair))


@pytest.fixture
def simulated_metal(monkeypatch):
    """The Metal dispatch path with the harness standing in for the GPU: exercises the lazy build,
    the self-check and the fallback that run on a Mac."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    runs = []

    def run_metal(plan):
        runs.append(plan.kernel)
        return harness.run(plan, source=sources.get(plan.kernel))

    sources: dict[str, str] = {}
    monkeypatch.setattr(kernels, "_metal_device", lambda: True)
    monkeypatch.setattr(kernels, "_run_metal", run_metal)
    monkeypatch.setattr(kernels, "_STATE", kernels._State())
    return runs, sources


def test_self_check_passes_and_metal_path_is_used(simulated_metal):
    runs, _ = simulated_metal
    assert set(kernels.active_kernels().values()) == {"metal"}
    rng = np.random.default_rng(19)
    args = _conv_args(rng, 2, 8, 48, 3)
    got = kernels.two_tap_conv(*args)
    assert runs == ["two_tap_conv", "two_tap_conv"]  # self-check, then the call
    assert not harness.compare_conv(got, *args)
    kernels.two_tap_conv(*args)
    assert runs.count("two_tap_conv") == 3  # checked once per dtype combination
    kernels.two_tap_conv(*_conv_args(rng, 2, 8, 48, 3, mx.bfloat16))
    assert runs.count("two_tap_conv") == 5
    assert kernels.prepare() == {name: "metal" for name in reference.KERNEL_NAMES}
    pair = _pair_args(rng, 2, 5, 4, 8, 30)
    np.testing.assert_array_equal(
        np.array(kernels.select_greedy(*pair)), np.array(reference.reference_select_greedy(*pair))
    )
    assert not kernels.disabled_kernels()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.ENV_VAR, "reference")
        before = len(runs)
        kernels.two_tap_conv(*args)
        assert len(runs) == before


def test_self_check_failure_falls_back_with_a_warning(simulated_metal):
    runs, sources = simulated_metal
    sources["select_greedy"] = _mutate("select_greedy", "if (s > best)", "if (s < best)")
    rng = np.random.default_rng(20)
    pair = _pair_args(rng, 2, 5, 4, 8, 30)
    with pytest.warns(RuntimeWarning, match="select_greedy.*self-check"):
        got = kernels.select_greedy(*pair)
    np.testing.assert_array_equal(np.array(got), np.array(reference.reference_select_greedy(*pair)))
    assert kernels.active_kernels()["select_greedy"] == "reference"
    assert kernels.active_kernels()["two_tap_conv"] == "metal"
    assert "select_greedy" in kernels.disabled_kernels()
    before = len(runs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.select_greedy(*pair)  # no second warning, no Metal run
    assert len(runs) == before
    # a kernel that does not even compile is also caught
    sources["two_tap_conv"] = "this is not C++"
    with pytest.warns(RuntimeWarning, match="two_tap_conv"):
        kernels.two_tap_conv(*_conv_args(rng, 1, 4, 32, 2))
    assert kernels.active_kernels()["two_tap_conv"] == "reference"


# ----- the self-check's decision, with the CPU harness (or a broken kernel) standing in for Metal


@pytest.mark.parametrize("dtype", selfcheck.CHECK_DTYPES, ids=str)
@pytest.mark.parametrize("name", reference.KERNEL_NAMES)
def test_self_check_passes_the_real_kernel_bodies_at_the_real_launch_widths(name, dtype):
    """check_kernel with the harness-compiled .metal body: it passes for every dtype, and the
    launch it checks is a real one (threadgroups of 256 threads, hidden 5120, k 16, rank 256)."""
    launched = []

    def run(plan):
        launched.append(plan)
        return harness.run(plan)

    assert selfcheck.check_kernel(name, dtype, run) is None
    (plan,) = launched
    assert plan.threadgroup[0] == 256
    args = selfcheck.check_args(name, dtype)
    if name == "two_tap_conv":
        assert args[0].shape == (1, 16, 5120) and args[1].shape == (1, 16, 2, 320)
    else:
        assert args[1].shape == (1, 15, 16) and args[3].shape == (1, 15, 256)
    assert all(
        a.dtype == dtype for a in args if isinstance(a, mx.array) and a.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


@pytest.mark.parametrize(
    "name,old,new",
    [
        ("two_tap_conv", "k1 * prev", "k1 * cur"),
        ("select_greedy", "if (s > best)", "if (s < best)"),
    ],
)
def test_self_check_rejects_a_wrong_kernel_body(name, old, new):
    source = _mutate(name, old, new)
    problem = selfcheck.check_kernel(name, mx.bfloat16, lambda plan: harness.run(plan, source=source))
    assert problem is not None and "bfloat16" in problem


def test_self_check_rejects_a_kernel_that_fails_to_launch_or_is_off_by_a_percent():
    def broken(plan):
        raise RuntimeError("Unable to build metal library from source\nerror: ...")

    assert selfcheck.check_kernel("two_tap_conv", mx.float32, broken).startswith("RuntimeError: Unable to build")

    def off(plan):  # the conv's output 1% off
        outs = list(harness.run(plan))
        outs[0] = outs[0] * 1.01
        return outs

    assert "max abs error" in selfcheck.check_kernel("two_tap_conv", mx.float32, off)


def test_self_check_computes_its_reference_on_the_cpu_stream(monkeypatch):
    """A GPU matmul may run as TF32: the reference is computed on the CPU stream."""
    devices = []
    reference_conv = reference.REFERENCES["two_tap_conv"]

    def recording(*args):
        devices.append(mx.default_device())
        return reference_conv(*args)

    monkeypatch.setitem(reference.REFERENCES, "two_tap_conv", recording)
    assert selfcheck.check_kernel("two_tap_conv", mx.float32, harness.run) is None
    assert devices == [mx.cpu]


def test_a_kernel_failing_for_one_dtype_is_disabled_for_that_dtype_only(simulated_metal, monkeypatch):
    runs, _ = simulated_metal

    def bf16_broken(plan):
        runs.append((plan.kernel, str(plan.inputs[0].dtype)))
        outs = harness.run(plan)
        return [o * 2 for o in outs] if plan.inputs[0].dtype == mx.bfloat16 and plan.kernel == "two_tap_conv" else outs

    monkeypatch.setattr(kernels, "_run_metal", bf16_broken)
    with pytest.warns(RuntimeWarning, match="two_tap_conv.*bfloat16"):
        active = kernels.prepare([mx.float32, mx.bfloat16])
    assert active["two_tap_conv"] == "metal (reference for bfloat16)"
    assert active["select_greedy"] == "metal"
    checks = kernels.self_checks()
    assert checks["two_tap_conv"]["float32"] == "pass" and checks["two_tap_conv"]["bfloat16"].startswith("fail")
    rng = np.random.default_rng(3)
    before = len(runs)
    kernels.two_tap_conv(*_conv_args(rng, 1, 8, 48, 3))  # float32: the kernel
    assert len(runs) == before + 1
    bf16 = _conv_args(rng, 1, 8, 48, 3, mx.bfloat16)
    got = kernels.two_tap_conv(*bf16)  # bfloat16: the reference, no launch, no new check
    assert len(runs) == before + 1
    assert mx.array_equal(got, reference.reference_two_tap_conv(*bf16))


def test_compiled_functions_are_self_checked_for_their_inputs_dtypes_before_the_trace(simulated_metal):
    """kernels.compiled runs the checks for every float dtype of the captured inputs (and
    float32) when it builds the compiled function, before anything is traced; a later call
    with those dtypes only launches (the harness cannot run inside a trace, so the launch is
    made eagerly here)."""
    runs, _ = simulated_metal
    weights = {"base": mx.ones((2, 48), dtype=mx.bfloat16)}
    traced = []

    def fn(x, dyn):
        traced.append(True)
        return kernels.two_tap_conv(x, dyn, weights["base"])

    kernels.compiled({}, "conv", fn, weights)
    assert not traced
    checks = kernels.self_checks()
    assert {d for name in reference.KERNEL_NAMES for d in checks[name]} == {"float32", "bfloat16"}
    before = len(runs)
    x, dyn, _ = _conv_args(np.random.default_rng(5), 1, 8, 48, 3, mx.bfloat16)
    kernels.two_tap_conv(x, dyn, weights["base"])
    assert len(runs) == before + 1  # the launch only: no check left to run


def test_loading_a_pair_self_checks_the_dtypes_the_models_use(simulated_metal, embedded_pair):
    from dflash2_mlx.models.loading import load_pair

    target, drafter = load_pair(str(embedded_pair[0]), str(embedded_pair[1]))
    dtypes = {
        str(a.dtype).split(".")[-1]
        for m in (target.runner.model, drafter)
        for _, a in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(m.parameters())
    }
    checks = kernels.self_checks()
    for name in reference.KERNEL_NAMES:
        assert set(checks[name]) >= dtypes & {"float32", "float16", "bfloat16"}
        assert all(v == "pass" for v in checks[name].values())
