"""The self-check: does a kernel launcher reproduce the reference ops on a fixed input?

Each kernel is compared with its reference once per float dtype, at the real launch widths
(threadgroups of 256 threads: hidden 5120 in groups of 16 for the conv; 15 selector rows of
k 16 candidates at rank 256), with every float input in that dtype. The reference runs on the
CPU stream, in float32 throughout (a GPU matmul may run as TF32). ``check_kernel`` is the whole
decision and takes the kernel launcher as an argument, so tests run it with the CPU harness
(or a broken kernel) in place of Metal; ``dispatch.py`` runs it with the Metal launch and
remembers the verdicts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from dflash2_mlx.kernels.plans import PLANNERS, Plan
from dflash2_mlx.kernels.reference import REFERENCES, pair_scores

__all__ = ["CHECK_DTYPES", "CHECK_WIDTHS", "check_args", "check_kernel"]

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
        return (normal((1, w["rows"], w["hidden"])), normal((1, w["rows"], 2, groups), 0.5), normal((2, w["hidden"])))
    rows, k, rank, vocab = w["rows"] - 1, w["k"], w["rank"], w["vocab"]
    anchor = mx.array(rng.integers(0, vocab, size=(1,)).astype(np.int32))
    cand = mx.array(np.stack([rng.permutation(vocab)[:k] for _ in range(rows)])[None].astype(np.int32))
    # scores of order one (a sum of 256 triple products of these has a std of about 0.5)
    args = [
        anchor,
        cand,
        normal((1, rows, k)),
        normal((1, rows, rank), 0.3),
        normal((vocab, rank), 0.3),
        normal((vocab, rank), 0.3),
    ]
    return tuple(args)


def check_kernel(name: str, dtype: mx.Dtype, run: Callable[[Plan], Sequence[mx.array]]) -> str | None:
    """Compare kernel ``name`` launched by ``run`` (``Plan`` -> raw outputs; on a Mac the Metal
    launch) with its reference on the CPU stream -> None when they agree, else why not.

    A greedy path may differ only where the reference's two best scores are within 1e-4 (relative)
    at the first differing row; values must agree within the dtype's tolerance
    (``_CHECK_TOLERANCE``)."""
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
    got, ref = np.array(result), np.array(want)  # select_greedy
    if np.array_equal(got, ref) or _near_tie(args, got, ref):
        return None
    return f"greedy path {got.tolist()} != reference {ref.tolist()} ({dtype})"


def _near_tie(args, got, want, margin=1e-4) -> bool:
    """Whether the first row where two greedy walks part is a near-tie of the reference's scores
    (computed in float32 on the CPU stream after the common predecessor)."""
    pairs = np.array(_on_cpu(pair_scores, *args))  # [N, R, k (a), k (b)]
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
