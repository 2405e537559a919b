"""The DFlash 2 hot spots: the two-tap dynamic convolution and the selector's pair scoring.

Each operation has a reference implementation in plain MLX ops (``reference_*``). The reference is
the specification: the fused Metal kernels in ``metal/`` must reproduce it, and it is the fallback
wherever Metal is not available (Linux CPU, CUDA).

Shapes (N independent blocks, L rows per block, H channels, G = H / group_size groups, K taps,
R selector rows, k candidates per row, r selector rank, V vocabulary):

- ``two_tap_conv(x [N, L, H], dynamic [N, L, K, G], base [K, H]) -> [N, L, H]``
  ``out[t, c] = sum_j (base[j, c] + dynamic[t, j, c // group]) * x[t - j, c]``, with x before a
  block's first row taken as zero (the convolution never crosses a block boundary).
- ``select_greedy(anchor [N], candidates [N, R, k], unary [N, R, k], hidden [N, R, r],
  predecessor_codebook [V, r], successor_codebook [V, r]) -> path [N, R]``
  Row i scores candidate b after predecessor a as
  ``unary[i, b] + sum(predecessor_codebook[a] * hidden[i] * successor_codebook[b])``;
  the walk starts at the anchor and takes the first maximum of each row.
- ``select_sampled(..., uniforms [N, R], temperature) -> (path [N, R], q [N, R, k])``
  q_i = softmax(scores_i / temperature) over the k candidates, and the chosen index is the first
  j with ``cumsum(q_i)[j] > u_i`` (inverse CDF with a pre-drawn uniform, so a kernel and the
  reference agree draw for draw).

Dispatch
--------
The public functions ``two_tap_conv``, ``select_greedy`` and ``select_sampled`` run, in order of
precedence:

1. an implementation installed with :func:`override` (tests route the engine through the CPU
   harness that compiles the ``.metal`` bodies with g++);
2. the reference ops when ``DFLASH2_MLX_KERNELS=reference`` is set;
3. the fused Metal kernel when ``mx.metal.is_available()`` and the default device is the GPU (as
   mlx-lm's gated-delta code decides), the call's shapes are supported (two taps, ...), and the
   kernel passed its self-check: the first time a kernel is used with a given combination of
   dtypes it is compared with the reference on a small random input; if it fails to build or
   disagrees, a warning is issued and that kernel uses the reference ops from then on;
4. the reference ops otherwise.

The decision is taken when the function is called, so inside ``mx.compile`` it is frozen at trace
time; call :func:`prepare` eagerly (e.g. at model load) to run the self-checks outside any trace.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

__all__ = [
    "two_tap_conv",
    "select_greedy",
    "select_sampled",
    "reference_two_tap_conv",
    "reference_select_greedy",
    "reference_select_sampled",
    "active_kernels",
    "override",
    "overridden",
    "prepare",
    "KERNEL_NAMES",
    "KERNEL_SPECS",
    "ENV_VAR",
]

ENV_VAR = "DFLASH2_MLX_KERNELS"
KERNEL_NAMES = ("two_tap_conv", "select_greedy", "select_sampled")


# ---------------------------------------------------------------------------------------------
# Reference implementations (the specification)
# ---------------------------------------------------------------------------------------------


def reference_two_tap_conv(x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
    """Grouped dynamic causal convolution local to each block (reference ops)."""
    n, length, hidden = x.shape
    taps, groups = dynamic.shape[-2], dynamic.shape[-1]
    xf = x.astype(mx.float32)
    # each group's coefficient repeated over its channels: [N, L, K * H] -> K x [N, L, H]
    per_channel = mx.broadcast_to(dynamic.astype(mx.float32)[..., None], (n, length, taps, groups, hidden // groups))
    dynamic_taps = mx.split(per_channel.reshape(n, length, taps * hidden), taps, axis=-1)
    base_taps = mx.split(base.astype(mx.float32), taps, axis=0)  # K x [1, H]
    out = None
    for j in range(taps):
        # tap j multiplies x[t - j], zero before the block's first row: a 0/1 shift matrix times
        # x (exact, and one op where slicing and padding are two)
        shift = np.broadcast_to(np.eye(length, k=-j, dtype=np.float32), (n, length, length))
        term = (base_taps[j] + dynamic_taps[j]) * (xf if j == 0 else mx.array(shift) @ xf)
        out = term if out is None else out + term
    return out.astype(x.dtype)


def _pair_scores(anchor, candidates, unary, hidden, pred_cb, succ_cb):
    """Every row's candidate scores for every possible predecessor, in one batch (float32)
    -> [N, R, k (a), k (b)]: row i's candidate b after candidate a of row i-1; row 0's
    predecessor is the anchor, in every slot a. The walks below then only pick rows of these."""
    n, rows, k = candidates.shape
    anchors = mx.broadcast_to(anchor.astype(candidates.dtype).reshape(n, 1, 1), (n, 1, k))
    predecessors = mx.concatenate([anchors, candidates[:, :-1]], axis=1)  # [N, R, k]
    left = pred_cb[predecessors].astype(mx.float32) * hidden.astype(mx.float32)[:, :, None, :]  # [N, R, k, r]
    succ = succ_cb[candidates].astype(mx.float32)  # [N, R, k, r]
    return unary.astype(mx.float32)[:, :, None, :] + left @ succ.swapaxes(-1, -2)


def pair_scores(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook) -> mx.array:
    """The selector's scores of every row's candidates after every possible predecessor
    [N, R, k, k] (float32), as the walks use them: for host-side walks (constrained drafting)."""
    return _pair_scores(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook)


def _walk(pairs, choose):
    """Follow the rows from predecessor slot 0 (the anchor): ``choose(i, scores [N, 1, 1, k])``
    returns the chosen index [N, 1, 1, 1]; row i's scores are those after the candidate chosen
    in row i-1 -> chosen indices [N, R]."""
    n, rows, k, _ = pairs.shape
    choice = mx.zeros((n, 1, 1, 1), dtype=mx.uint32)
    chosen = []
    for i, row in enumerate(mx.split(pairs, rows, axis=1)):  # row: [N, 1, k, k]
        choice = choose(i, mx.take_along_axis(row, choice, axis=2))
        chosen.append(choice)
    return mx.concatenate(chosen, axis=1).reshape(n, rows)


def reference_select_greedy(
    anchor: mx.array,
    candidates: mx.array,
    unary: mx.array,
    hidden: mx.array,
    predecessor_codebook: mx.array,
    successor_codebook: mx.array,
) -> mx.array:
    """Greedy path through each row's candidates, starting from the anchor token."""
    pairs = _pair_scores(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook)
    # Each row's best candidate after each possible predecessor, for all rows at once; the walk
    # then only follows these pointers (one gather per row).
    best = mx.argmax(pairs, axis=-1).astype(mx.int32)  # [N, R, k]
    n, rows, _ = best.shape
    choice = mx.zeros((n, 1, 1), dtype=mx.int32)  # row 0's predecessor slot: the anchor
    chosen = []
    for row in mx.split(best, rows, axis=1):  # [N, 1, k]
        choice = mx.take_along_axis(row, choice, axis=-1)  # [N, 1, 1]
        chosen.append(choice)
    return mx.take_along_axis(candidates, mx.concatenate(chosen, axis=1), axis=-1)[..., 0]


def reference_select_sampled(
    anchor: mx.array,
    candidates: mx.array,
    unary: mx.array,
    hidden: mx.array,
    predecessor_codebook: mx.array,
    successor_codebook: mx.array,
    uniforms: mx.array,
    temperature: float,
) -> tuple[mx.array, mx.array]:
    """Sampled path plus each row's proposal distribution q over its k candidates."""
    k = candidates.shape[-1]
    pairs = _pair_scores(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook)
    u = uniforms.astype(mx.float32).reshape(uniforms.shape[0], -1, 1, 1)
    q_rows = []

    def draw(i, scores):
        q = mx.softmax(scores / temperature, axis=-1)
        q_rows.append(q)
        below = (mx.cumsum(q, axis=-1) <= u[:, i : i + 1]).astype(mx.int32)
        return mx.minimum(mx.sum(below, axis=-1, keepdims=True), k - 1)

    chosen = _walk(pairs, draw)
    path = mx.take_along_axis(candidates, chosen[..., None], axis=-1)[..., 0]
    return path, mx.concatenate(q_rows, axis=1).reshape(*candidates.shape)


REFERENCES: dict[str, Callable] = {
    "two_tap_conv": reference_two_tap_conv,
    "select_greedy": reference_select_greedy,
    "select_sampled": reference_select_sampled,
}


# ---------------------------------------------------------------------------------------------
# Kernel descriptions and launch plans (shared by the Metal path and the tests' CPU harness)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSpec:
    """What ``mx.fast.metal_kernel`` is built from."""

    name: str  # the metal_kernel name (MLX prefixes "custom_kernel_")
    filename: str  # body text in metal/
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    header: str = ""


KERNEL_SPECS: dict[str, KernelSpec] = {
    "two_tap_conv": KernelSpec(
        name="dflash2_two_tap_conv",
        filename="two_tap_conv.metal",
        input_names=("x", "dyn", "base"),
        output_names=("out",),
    ),
    "select_greedy": KernelSpec(
        name="dflash2_pair_greedy",
        filename="pair_scores.metal",
        input_names=("anchor", "candidates", "unary", "hidden", "pred_cb", "succ_cb"),
        output_names=("path", "scores"),
        header="#define DFLASH2_PAIR_SAMPLED 0\n",
    ),
    "select_sampled": KernelSpec(
        name="dflash2_pair_sampled",
        filename="pair_scores.metal",
        input_names=(
            "anchor", "candidates", "unary", "hidden", "pred_cb", "succ_cb",
            "uniforms", "temperature",
        ),
        output_names=("path", "q", "scores"),
        header="#define DFLASH2_PAIR_SAMPLED 1\n",
    ),
}


@dataclass
class Plan:
    """One kernel launch: the arguments of a ``mx.fast.metal_kernel`` call plus ``finish``, which
    turns the kernel's outputs into the public function's result."""

    kernel: str  # key of KERNEL_SPECS
    inputs: list[mx.array]
    template: list[tuple[str, object]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    finish: Callable[[Sequence[mx.array]], object]
    init_value: float | None = None

    @property
    def spec(self) -> KernelSpec:
        return KERNEL_SPECS[self.kernel]


_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_INTS = (mx.int32, mx.uint32, mx.int64, mx.uint64, mx.int16, mx.uint16, mx.int8, mx.uint8)
_PAIR_MAX_THREADS = 256


def _as_float(a: mx.array) -> mx.array:
    return a if a.dtype in _FLOATS else a.astype(mx.float32)


def plan_two_tap_conv(x: mx.array, dynamic: mx.array, base: mx.array) -> Plan | None:
    """Launch plan of the fused two-tap conv, or None when the call needs the reference ops."""
    if x.ndim != 3 or dynamic.ndim != 4 or base.ndim != 2:
        return None
    n, length, hidden = x.shape
    if dynamic.shape[0] != n or dynamic.shape[1] != length or dynamic.shape[2] != 2:
        return None
    groups = dynamic.shape[3]
    if tuple(base.shape) != (2, hidden) or groups <= 0 or hidden % groups != 0:
        return None
    if x.dtype not in _FLOATS or min(n, length, hidden) <= 0:
        return None
    return Plan(
        kernel="two_tap_conv",
        inputs=[x, _as_float(dynamic), _as_float(base)],
        template=[("T", x.dtype)],
        grid=(hidden, n, 1),
        threadgroup=(min(256, hidden), 1, 1),
        output_shapes=[(n, length, hidden)],
        output_dtypes=[x.dtype],
        finish=lambda outs: outs[0],
    )


def _pair_inputs(anchor, candidates, unary, hidden, pred_cb, succ_cb):
    if candidates.ndim != 3 or anchor.ndim != 1 or unary.ndim != 3 or hidden.ndim != 3:
        return None
    if pred_cb.ndim != 2 or succ_cb.ndim != 2:
        return None
    n, rows, k = candidates.shape
    rank = hidden.shape[2]
    if min(n, rows, k, rank) <= 0 or anchor.shape[0] != n:
        return None
    if tuple(unary.shape) != (n, rows, k) or tuple(hidden.shape[:2]) != (n, rows):
        return None
    if pred_cb.shape[1] != rank or succ_cb.shape[1] != rank:
        return None
    if candidates.dtype not in _INTS or anchor.dtype not in _INTS:
        return None
    inputs = [
        anchor.astype(mx.int32),
        candidates.astype(mx.int32),
        _as_float(unary),
        _as_float(hidden),
        _as_float(pred_cb),
        _as_float(succ_cb),
    ]
    items = k + (rows - 1) * k * k
    threads = min(_PAIR_MAX_THREADS, 32 * ((items + 31) // 32))
    return inputs, (n, rows, k), threads


def plan_select_greedy(
    anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook
) -> Plan | None:
    """Launch plan of the fused greedy pair-score walk, or None (reference ops)."""
    prepared = _pair_inputs(
        anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook
    )
    if prepared is None:
        return None
    inputs, (n, rows, k), threads = prepared
    out_dtype = candidates.dtype

    def finish(outs):
        path = outs[0]
        return path if out_dtype == mx.int32 else path.astype(out_dtype)

    return Plan(
        kernel="select_greedy",
        inputs=inputs,
        template=[],
        grid=(threads, n, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(n, rows), (n, rows, k, k)],
        output_dtypes=[mx.int32, mx.float32],
        finish=finish,
    )


def plan_select_sampled(
    anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook,
    uniforms, temperature,
) -> Plan | None:
    """Launch plan of the fused sampled pair-score walk, or None (reference ops)."""
    prepared = _pair_inputs(
        anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook
    )
    if prepared is None:
        return None
    inputs, (n, rows, k), threads = prepared
    if tuple(uniforms.shape) != (n, rows):
        return None
    if isinstance(temperature, mx.array):
        if temperature.size != 1:
            return None
        temp = temperature.reshape(1).astype(mx.float32)
    else:
        temp = mx.array([float(temperature)], dtype=mx.float32)
    inputs = inputs + [_as_float(uniforms), temp]
    out_dtype = candidates.dtype

    def finish(outs):
        path = outs[0]
        path = path if out_dtype == mx.int32 else path.astype(out_dtype)
        return path, outs[1]

    return Plan(
        kernel="select_sampled",
        inputs=inputs,
        template=[],
        grid=(threads, n, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(n, rows), (n, rows, k), (n, rows, k, k)],
        output_dtypes=[mx.int32, mx.float32, mx.float32],
        finish=finish,
    )


PLANNERS: dict[str, Callable[..., Plan | None]] = {
    "two_tap_conv": plan_two_tap_conv,
    "select_greedy": plan_select_greedy,
    "select_sampled": plan_select_sampled,
}


def load_source(spec: KernelSpec | str) -> str:
    """The body text of a kernel: package data ``dflash2_mlx.metal`` when installed, else the
    repository's top-level ``metal/`` folder next to the package (running from the source tree)."""
    if isinstance(spec, str):
        spec = KERNEL_SPECS[spec]
    try:
        from importlib.resources import files

        resource = files("dflash2_mlx.metal").joinpath(spec.filename)
        if resource.is_file():
            return resource.read_text(encoding="utf-8")
    except (ImportError, ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
        pass
    path = Path(__file__).resolve().parent.parent / "metal" / spec.filename
    if not path.is_file():
        raise FileNotFoundError(
            f"Metal kernel source {spec.filename!r} not found in package data "
            f"'dflash2_mlx.metal' nor at {path}"
        )
    return path.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Dispatch state
# ---------------------------------------------------------------------------------------------


@dataclass
class _State:
    lock: threading.RLock = field(default_factory=threading.RLock)
    overrides: dict[str, Callable] = field(default_factory=dict)
    built: dict[str, object] = field(default_factory=dict)  # name -> mx.fast.metal_kernel
    checked: dict[tuple, bool] = field(default_factory=dict)  # (name, dtypes) -> passed
    disabled: dict[str, str] = field(default_factory=dict)  # name -> reason


_STATE = _State()


def _forced_reference() -> bool:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return value == "reference"


def _metal_device() -> bool:
    try:
        return bool(mx.metal.is_available()) and mx.default_device() == mx.gpu
    except Exception:  # pragma: no cover - exotic builds without mx.metal
        return False


def _build(name: str):
    """The mx.fast.metal_kernel for ``name``, built once (lazily) and cached."""
    with _STATE.lock:
        kernel = _STATE.built.get(name)
        if kernel is None:
            spec = KERNEL_SPECS[name]
            kernel = mx.fast.metal_kernel(
                name=spec.name,
                input_names=list(spec.input_names),
                output_names=list(spec.output_names),
                source=load_source(spec),
                header=spec.header,
            )
            _STATE.built[name] = kernel
        return kernel


def _run_metal(plan: Plan) -> list[mx.array]:
    kernel = _build(plan.kernel)
    kwargs = dict(
        inputs=plan.inputs,
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=plan.output_shapes,
        output_dtypes=plan.output_dtypes,
    )
    if plan.template:
        kwargs["template"] = plan.template
    if plan.init_value is not None:
        kwargs["init_value"] = plan.init_value
    return kernel(**kwargs)


# ----- self-check -----------------------------------------------------------------------------

_CHECK_TOLERANCE = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 1e-2}


def _check_key(plan: Plan) -> tuple:
    return (plan.kernel, tuple(str(a.dtype) for a in plan.inputs), tuple(map(str, plan.template)))


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)


def _check_conv(dtypes: Sequence[mx.Dtype]) -> str | None:
    rng = np.random.default_rng(20240501)
    n, length, hidden, groups = 2, 5, 48, 3
    x = mx.array(rng.standard_normal((n, length, hidden)).astype(np.float32)).astype(dtypes[0])
    dyn = mx.array(rng.standard_normal((n, length, 2, groups)).astype(np.float32)).astype(dtypes[1])
    base = mx.array(rng.standard_normal((2, hidden)).astype(np.float32)).astype(dtypes[2])
    plan = plan_two_tap_conv(x, dyn, base)
    got = plan.finish(_run_metal(plan))
    want = reference_two_tap_conv(x, dyn, base)
    mx.eval(got, want)
    err = float(np.max(np.abs(_np(got) - _np(want))))
    scale = max(1.0, float(np.max(np.abs(_np(want)))))
    tol = _CHECK_TOLERANCE.get(x.dtype, 1e-2) * scale
    if not np.isfinite(err) or err > tol:
        return f"max abs error {err:.3g} > {tol:.3g} ({x.dtype})"
    return None


def _pair_case(dtypes: Sequence[mx.Dtype], sampled: bool):
    rng = np.random.default_rng(20240502)
    n, rows, k, rank, vocab = 2, 4, 4, 8, 32
    anchor = mx.array(rng.integers(0, vocab, size=(n,)).astype(np.int32))
    cand = mx.array(
        np.stack([rng.permutation(vocab)[:k] for _ in range(n * rows)]).reshape(n, rows, k)
        .astype(np.int32)
    )

    def normal(shape, dtype):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    args = [
        anchor, cand,
        normal((n, rows, k), dtypes[2]), normal((n, rows, rank), dtypes[3]),
        normal((vocab, rank), dtypes[4]), normal((vocab, rank), dtypes[5]),
    ]
    if sampled:
        args += [mx.array(rng.random((n, rows)).astype(np.float32)).astype(dtypes[6]), 0.8]
    return args


def _check_greedy(dtypes: Sequence[mx.Dtype]) -> str | None:
    args = _pair_case(dtypes, sampled=False)
    plan = plan_select_greedy(*args)
    outs = _run_metal(plan)
    got = plan.finish(outs)
    want = reference_select_greedy(*args)
    mx.eval(got, want)
    if np.array_equal(np.array(got), np.array(want)):
        return None
    if _near_tie(np.array(outs[1]), np.array(got), np.array(want), args):
        return None  # a 1-ulp disagreement at a near-tie says nothing about the kernel
    return f"greedy path {np.array(got).tolist()} != reference {np.array(want).tolist()}"


def _near_tie(scores, got, want, args, margin=1e-4) -> bool:
    """Whether the first disagreeing row of a greedy walk is a near-tie of the kernel's scores."""
    cand = np.array(args[1])
    n, rows, k = cand.shape
    for b in range(n):
        a = 0
        for i in range(rows):
            row = scores[b, i, a]
            if got[b, i] != want[b, i]:
                top = np.sort(row)[-2:] if k > 1 else row
                return bool(k > 1 and abs(top[1] - top[0]) < margin * max(1.0, abs(top[1])))
            a = int(np.nonzero(cand[b, i] == got[b, i])[0][0])
    return False


def _check_sampled(dtypes: Sequence[mx.Dtype]) -> str | None:
    args = _pair_case(dtypes, sampled=True)
    plan = plan_select_sampled(*args)
    got_path, got_q = plan.finish(_run_metal(plan))
    want_path, want_q = reference_select_sampled(*args)
    mx.eval(got_path, got_q, want_path, want_q)
    gp, wp = np.array(got_path), np.array(want_path)
    gq, wq = np.array(got_q), np.array(want_q)
    if not np.array_equal(gp, wp):
        # Only acceptable if the first disagreement sits within 1e-4 of an inverse-CDF boundary.
        u = np.array(args[6].astype(mx.float32))
        bad = np.argwhere(gp != wp)
        first = min(map(tuple, bad), key=lambda t: (t[1], t[0]))
        cdf = np.cumsum(wq[first[0], first[1]])
        if np.min(np.abs(cdf - u[first[0], first[1]])) >= 1e-4:
            return f"sampled path {gp.tolist()} != reference {wp.tolist()}"
        return None
    err = float(np.max(np.abs(gq - wq)))
    if not np.isfinite(err) or err > 1e-5:
        return f"sampled q max abs error {err:.3g} > 1e-05"
    return None


_CHECKS = {
    "two_tap_conv": _check_conv,
    "select_greedy": _check_greedy,
    "select_sampled": _check_sampled,
}


def _self_check(plan: Plan) -> bool:
    """Run (once per kernel and dtype combination) the comparison with the reference."""
    key = _check_key(plan)
    with _STATE.lock:
        if plan.kernel in _STATE.disabled:
            return False
        if key in _STATE.checked:
            return _STATE.checked[key]
        try:
            problem = _CHECKS[plan.kernel]([a.dtype for a in plan.inputs])
        except Exception as exc:  # build/compile/launch failure
            problem = f"{type(exc).__name__}: {exc}"
        passed = problem is None
        _STATE.checked[key] = passed
        if not passed:
            _STATE.disabled[plan.kernel] = problem
            warnings.warn(
                f"dflash2-mlx: the Metal kernel {plan.kernel!r} failed its self-check against the "
                f"reference ({problem}); using the reference MLX ops for it from now on.",
                RuntimeWarning,
                stacklevel=4,
            )
        return passed


def _dispatch(name: str, args: tuple):
    fn = _STATE.overrides.get(name)
    if fn is not None:
        return fn(*args)
    if not _forced_reference() and _metal_device() and name not in _STATE.disabled:
        plan = PLANNERS[name](*args)
        if plan is not None and _self_check(plan):
            return plan.finish(_run_metal(plan))
    return REFERENCES[name](*args)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def two_tap_conv(x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
    """Grouped dynamic causal convolution local to each block (see module docstring)."""
    return _dispatch("two_tap_conv", (x, dynamic, base))


def select_greedy(
    anchor: mx.array,
    candidates: mx.array,
    unary: mx.array,
    hidden: mx.array,
    predecessor_codebook: mx.array,
    successor_codebook: mx.array,
) -> mx.array:
    """Greedy path through each row's candidates, starting from the anchor token."""
    return _dispatch(
        "select_greedy",
        (anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook),
    )


def select_sampled(
    anchor: mx.array,
    candidates: mx.array,
    unary: mx.array,
    hidden: mx.array,
    predecessor_codebook: mx.array,
    successor_codebook: mx.array,
    uniforms: mx.array,
    temperature: float,
) -> tuple[mx.array, mx.array]:
    """Sampled path plus each row's proposal distribution q over its k candidates."""
    return _dispatch(
        "select_sampled",
        (anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook,
         uniforms, temperature),
    )


@contextlib.contextmanager
def override(
    *,
    two_tap_conv: Callable | None = None,
    select_greedy: Callable | None = None,
    select_sampled: Callable | None = None,
) -> Iterator[None]:
    """Route the public kernel functions through other implementations inside a ``with`` block.

    Each given callable takes the public function's arguments and returns its result (it must not
    call the public function itself). Names left as None keep their current routing. The routing
    is process-wide (not per thread), so an engine worker thread sees it too; nested blocks
    restore the previous routing on exit.
    """
    new = {
        name: fn
        for name, fn in (
            ("two_tap_conv", two_tap_conv),
            ("select_greedy", select_greedy),
            ("select_sampled", select_sampled),
        )
        if fn is not None
    }
    with _STATE.lock:
        saved = dict(_STATE.overrides)
        _STATE.overrides.update(new)
    try:
        yield
    finally:
        with _STATE.lock:
            _STATE.overrides.clear()
            _STATE.overrides.update(saved)


def prepare() -> dict[str, str]:
    """Run the float32 self-checks now (eagerly, outside any mx.compile trace) where Metal would
    be used; returns :func:`active_kernels`."""
    if not _forced_reference() and _metal_device():
        for name in KERNEL_NAMES:
            if name in _STATE.disabled:
                continue
            dtypes = {
                "two_tap_conv": [mx.float32] * 3,
                "select_greedy": [mx.int32, mx.int32] + [mx.float32] * 4,
                "select_sampled": [mx.int32, mx.int32] + [mx.float32] * 6,
            }[name]
            args = _check_args(name, dtypes)
            plan = PLANNERS[name](*args)
            if plan is not None:
                _self_check(plan)
    return active_kernels()


def _check_args(name: str, dtypes):
    if name == "two_tap_conv":
        return (
            mx.zeros((1, 2, 16), dtypes[0]), mx.zeros((1, 2, 2, 1), dtypes[1]),
            mx.zeros((2, 16), dtypes[2]),
        )
    return tuple(_pair_case(dtypes, sampled=(name == "select_sampled")))


def overridden() -> bool:
    """True inside an :func:`override` block (callers that compile skip it there: an override's
    callbacks may need concrete arrays)."""
    return bool(_STATE.overrides)


def compiled(cache: dict, name: str, fn: Callable, inputs) -> Callable:
    """``fn`` compiled with ``inputs`` captured (one trace per input shape, kept in ``cache``
    under ``name``), or ``fn`` itself inside an :func:`override` block, whose callbacks may need
    concrete arrays. The Metal self-checks run first, eagerly: never inside a trace."""
    if overridden():
        return fn
    if name not in cache:
        prepare()
        cache[name] = mx.compile(fn, inputs=inputs)
    return cache[name]


def active_kernels() -> dict[str, str]:
    """Kernel name -> "override" (routed by :func:`override`), "metal" (the fused kernel is used
    where the call's shapes allow it; it has not failed a self-check) or "reference" (plain MLX
    ops: forced by DFLASH2_MLX_KERNELS=reference, no Metal GPU as the default device, or the
    kernel failed its self-check). For ``doctor``."""
    forced = _forced_reference()
    metal = _metal_device()
    result = {}
    with _STATE.lock:
        for name in KERNEL_NAMES:
            if name in _STATE.overrides:
                result[name] = "override"
            elif forced or not metal or name in _STATE.disabled:
                result[name] = "reference"
            else:
                result[name] = "metal"
    return result


def disabled_kernels() -> dict[str, str]:
    """Kernels that failed their self-check on this machine, with the reason."""
    with _STATE.lock:
        return dict(_STATE.disabled)
