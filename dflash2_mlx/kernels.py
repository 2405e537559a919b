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
   kernel passed its self-check for every float dtype among the call's inputs: once per kernel
   and dtype it is compared at the real launch widths with the reference computed on the CPU
   stream (``check_kernel``); if it fails to build or disagrees, a warning is issued and that
   kernel uses the reference ops for that dtype from then on;
4. the reference ops otherwise.

The decision is taken when the function is called, so inside ``mx.compile`` it is frozen at trace
time: :func:`prepare` runs the self-checks for the dtypes a model uses eagerly (at load, and in
:func:`compiled` before each trace), never inside a trace.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass, field
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
    """The body text of a kernel: package data in ``dflash2_mlx/metal/``."""
    if isinstance(spec, str):
        spec = KERNEL_SPECS[spec]
    from importlib.resources import files

    resource = files("dflash2_mlx.kernels.metal").joinpath(spec.filename)
    if not resource.is_file():
        raise FileNotFoundError(
            f"Metal kernel source {spec.filename!r} is missing from dflash2_mlx/metal/: reinstall the package"
        )
    return resource.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Dispatch state
# ---------------------------------------------------------------------------------------------


@dataclass
class _State:
    lock: threading.RLock = field(default_factory=threading.RLock)
    overrides: dict[str, Callable] = field(default_factory=dict)
    built: dict[str, object] = field(default_factory=dict)  # name -> mx.fast.metal_kernel
    # (name, dtype name) -> None (passed) or why it failed; a failure disables that pair only
    checked: dict[tuple[str, str], str | None] = field(default_factory=dict)


_STATE = _State()


def _forced_reference() -> bool:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return value == "reference"


def _metal_device() -> bool:
    from dflash2_mlx.backend import device

    return device.metal_gpu()


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
#
# Each kernel is compared with its reference once per float dtype, at the real launch widths
# (threadgroups of 256 threads: hidden 5120 in groups of 16 for the conv; 15 selector rows of
# k 16 candidates at rank 256), with every float input in that dtype. The reference runs on the
# CPU stream, in float32 throughout (a GPU matmul may run as TF32). ``check_kernel`` is the whole
# decision and takes the kernel launcher as an argument, so tests run it with the CPU harness
# (or a broken kernel) in place of Metal.

CHECK_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# Output tolerance relative to the output's scale: the kernels compute in float32, so float32
# agrees to summation order; half and bfloat16 outputs are rounded once (bf16: 2^-8 relative).
_CHECK_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}
CHECK_WIDTHS = {"rows": 16, "hidden": 5120, "group": 16, "k": 16, "rank": 256, "vocab": 4096}


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)


def _on_cpu(fn, *args):
    """The reference's result, computed on the CPU stream and evaluated."""
    with mx.stream(mx.cpu):
        out = fn(*args)
        mx.eval(out)
    return out


def check_args(name: str, dtype: mx.Dtype) -> tuple:
    """The self-check's inputs for kernel ``name`` with every float input in ``dtype``, at the
    real launch widths (``CHECK_WIDTHS``); fixed seeds, so every machine checks the same case."""
    w = CHECK_WIDTHS
    rng = np.random.default_rng(20240501)

    def normal(shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    if name == "two_tap_conv":
        groups = w["hidden"] // w["group"]
        return (normal((1, w["rows"], w["hidden"])), normal((1, w["rows"], 2, groups), 0.5),
                normal((2, w["hidden"])))
    rows, k, rank, vocab = w["rows"] - 1, w["k"], w["rank"], w["vocab"]
    anchor = mx.array(rng.integers(0, vocab, size=(1,)).astype(np.int32))
    cand = mx.array(np.stack([rng.permutation(vocab)[:k] for _ in range(rows)])[None].astype(np.int32))
    # scores of order one (a sum of 256 triple products of these has a std of about 0.5)
    args = [anchor, cand, normal((1, rows, k)), normal((1, rows, rank), 0.3),
            normal((vocab, rank), 0.3), normal((vocab, rank), 0.3)]
    if name == "select_sampled":
        args += [mx.array(rng.random((1, rows)).astype(np.float32)).astype(dtype), 0.8]
    return tuple(args)


def check_kernel(name: str, dtype: mx.Dtype, run: Callable[[Plan], Sequence[mx.array]]) -> str | None:
    """Compare kernel ``name`` launched by ``run`` (``Plan`` -> raw outputs; on a Mac the Metal
    launch) with its reference on the CPU stream -> None when they agree, else why not.

    A greedy path may differ only where the reference's two best scores are within 1e-4 (relative)
    at the first differing row; a sampled path only where the uniform lies within 1e-4 of a CDF
    boundary; values must agree within the dtype's tolerance (``_CHECK_TOLERANCE``)."""
    args = check_args(name, dtype)
    plan = PLANNERS[name](*args)
    if plan is None:
        return f"the self-check's shapes are not supported by the {name} kernel"
    try:
        outs = list(run(plan))
        result = plan.finish(outs)
        mx.eval(result)
    except Exception as exc:  # build/compile/launch failure
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    want = _on_cpu(REFERENCES[name], *args)
    if name == "two_tap_conv":
        err = float(np.max(np.abs(_np(result) - _np(want))))
        tol = _CHECK_TOLERANCE.get(dtype, 1e-2) * max(1.0, float(np.max(np.abs(_np(want)))))
        if not np.isfinite(err) or err > tol:
            return f"max abs error {err:.3g} > {tol:.3g} ({dtype})"
        return None
    if name == "select_greedy":
        got, ref = np.array(result), np.array(want)
        if np.array_equal(got, ref) or _near_tie(args, got, ref):
            return None
        return f"greedy path {got.tolist()} != reference {ref.tolist()} ({dtype})"
    (got_path, got_q), (want_path, want_q) = result, want
    gp, wp, gq, wq = np.array(got_path), np.array(want_path), _np(got_q), _np(want_q)
    if not np.array_equal(gp, wp):
        u = _np(args[6])
        first = min(map(tuple, np.argwhere(gp != wp)), key=lambda t: (t[1], t[0]))
        cdf = np.cumsum(wq[first[0], first[1]])
        if np.min(np.abs(cdf - u[first[0], first[1]])) >= 1e-4:
            return f"sampled path {gp.tolist()} != reference {wp.tolist()} ({dtype})"
        return None
    err = float(np.max(np.abs(gq - wq)))
    if not np.isfinite(err) or err > 1e-5:
        return f"sampled q max abs error {err:.3g} > 1e-05 ({dtype})"
    return None


def _near_tie(args, got, want, margin=1e-4) -> bool:
    """Whether the first row where two greedy walks part is a near-tie of the reference's scores
    (computed in float32 on the CPU stream after the common predecessor)."""
    pairs = np.array(_on_cpu(_pair_scores, *args))  # [N, R, k (a), k (b)]
    cand = np.array(args[1])
    n, rows, k = cand.shape
    for b in range(n):
        a = 0
        for i in range(rows):
            if got[b, i] != want[b, i]:
                top = np.sort(pairs[b, i, a])[-2:]
                return bool(k > 1 and abs(top[1] - top[0]) < margin * max(1.0, abs(top[1])))
            a = int(np.nonzero(cand[b, i] == got[b, i])[0][0])
    return False


def _plan_dtypes(plan: Plan) -> list[mx.Dtype]:
    """The float dtypes among a launch's inputs (each must have passed its self-check)."""
    seen = []
    for a in plan.inputs:
        if a.dtype in _FLOATS and a.dtype not in seen:
            seen.append(a.dtype)
    return seen


def _self_check(name: str, dtype: mx.Dtype) -> bool:
    """Run (once per kernel and dtype) the comparison with the reference; a failure disables
    the kernel for that dtype only, with a warning."""
    key = (name, str(dtype))
    with _STATE.lock:
        if key not in _STATE.checked:
            problem = check_kernel(name, dtype, _run_metal)
            _STATE.checked[key] = problem
            if problem is not None:
                warnings.warn(
                    f"dflash2-mlx: the Metal kernel {name!r} failed its self-check against the "
                    f"reference for {dtype} ({problem}); using the reference MLX ops for it with "
                    f"{dtype} inputs from now on.",
                    RuntimeWarning,
                    stacklevel=5,
                )
        return _STATE.checked[key] is None


def _metal_allowed(plan: Plan) -> bool:
    """Every float dtype of the launch passed its self-check (run now if it has not been: callers
    that compile run :func:`prepare` first, so this never happens inside a trace)."""
    return all(_self_check(plan.kernel, dtype) for dtype in _plan_dtypes(plan))


def _dispatch(name: str, args: tuple):
    fn = _STATE.overrides.get(name)
    if fn is not None:
        return fn(*args)
    if not _forced_reference() and _metal_device():
        plan = PLANNERS[name](*args)
        if plan is not None and _metal_allowed(plan):
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


def prepare(dtypes: Sequence[mx.Dtype] = (mx.float32,)) -> dict[str, str]:
    """Run the self-checks of every kernel for each float dtype in ``dtypes`` now (eagerly: at
    load, before any mx.compile trace) where Metal would be used; returns :func:`active_kernels`.
    Already checked pairs are not checked again."""
    if not _forced_reference() and _metal_device():
        for name in KERNEL_NAMES:
            for dtype in dtypes:
                if dtype in _FLOATS:
                    _self_check(name, dtype)
    return active_kernels()


def float_dtypes(tree) -> list[mx.Dtype]:
    """The float dtypes of the arrays in a parameter tree (what a model's kernels will see),
    plus float32 (logits, scores)."""
    from mlx.utils import tree_flatten

    found = [mx.float32]
    for _, a in tree_flatten(tree):
        if isinstance(a, mx.array) and a.dtype in _FLOATS and a.dtype not in found:
            found.append(a.dtype)
    return found


def overridden() -> bool:
    """True inside an :func:`override` block (callers that compile skip it there: an override's
    callbacks may need concrete arrays)."""
    return bool(_STATE.overrides)


def compiled(cache: dict, name: str, fn: Callable, inputs) -> Callable:
    """``fn`` compiled with ``inputs`` captured (one trace per input shape, kept in ``cache``
    under ``name``), or ``fn`` itself inside an :func:`override` block, whose callbacks may need
    concrete arrays. The Metal self-checks for the inputs' dtypes run first, eagerly: never
    inside a trace."""
    if overridden():
        return fn
    if name not in cache:
        prepare(float_dtypes(inputs))
        cache[name] = mx.compile(fn, inputs=inputs)
    return cache[name]


def active_kernels() -> dict[str, str]:
    """Kernel name -> "override" (routed by :func:`override`), "metal" (the fused kernel is used
    where the call's shapes allow it; it has not failed a self-check), "reference" (plain MLX
    ops: forced by DFLASH2_MLX_KERNELS=reference, no Metal GPU as the default device, or the
    kernel failed every self-check it ran) or "metal (reference for <dtypes>)" (it failed for
    those dtypes only). For ``doctor``."""
    forced = _forced_reference()
    metal = _metal_device()
    result = {}
    with _STATE.lock:
        for name in KERNEL_NAMES:
            results = {d: p for (n, d), p in _STATE.checked.items() if n == name}
            failed = sorted(d.split(".")[-1] for d, p in results.items() if p is not None)
            if name in _STATE.overrides:
                result[name] = "override"
            elif forced or not metal or (results and len(failed) == len(results)):
                result[name] = "reference"
            elif failed:
                result[name] = f"metal (reference for {', '.join(failed)})"
            else:
                result[name] = "metal"
    return result


def self_checks() -> dict[str, dict[str, str]]:
    """Kernel name -> {dtype: "pass" or "fail: why"} of the self-checks run so far."""
    out: dict[str, dict[str, str]] = {name: {} for name in KERNEL_NAMES}
    with _STATE.lock:
        for (name, dtype), problem in _STATE.checked.items():
            out[name][dtype.split(".")[-1]] = "pass" if problem is None else f"fail: {problem}"
    return out


def disabled_kernels() -> dict[str, str]:
    """Kernels that failed a self-check on this machine (for some dtype), with the reason."""
    with _STATE.lock:
        out: dict[str, str] = {}
        for (name, dtype), problem in _STATE.checked.items():
            if problem is not None:
                out[name] = f"{out[name]}; {problem}" if name in out else problem
        return out
