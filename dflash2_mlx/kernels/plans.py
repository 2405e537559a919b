"""Launch plans of the fused Metal kernels: what each kernel is built from and how a call maps to it.

A ``KernelSpec`` names a kernel's body in ``metal/`` and its inputs and outputs; a planner
(``plan_*``) turns a public function's arguments into a ``Plan`` (inputs, grid, threadgroup,
output shapes and how the outputs become the function's result) or None when the call's shapes
need the reference ops. The plans are shared by the Metal launch (``dispatch.py``), the
self-check (``selfcheck.py``) and the tests' CPU harness, so all three run the same launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

__all__ = [
    "FLOAT_DTYPES",
    "KERNEL_SPECS",
    "PLANNERS",
    "KernelSpec",
    "Plan",
    "load_source",
    "plan_select_greedy",
    "plan_two_tap_conv",
]


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


# The float dtypes a kernel accepts (and is self-checked in); other inputs are cast to float32.
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_INTS = (mx.int32, mx.uint32, mx.int64, mx.uint64, mx.int16, mx.uint16, mx.int8, mx.uint8)
_PAIR_MAX_THREADS = 256


def _as_float(a: mx.array) -> mx.array:
    return a if a.dtype in FLOAT_DTYPES else a.astype(mx.float32)


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
    if x.dtype not in FLOAT_DTYPES or min(n, length, hidden) <= 0:
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


def plan_select_greedy(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook) -> Plan | None:
    """Launch plan of the fused greedy pair-score walk, or None (reference ops)."""
    prepared = _pair_inputs(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook)
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


PLANNERS: dict[str, Callable[..., Plan | None]] = {
    "two_tap_conv": plan_two_tap_conv,
    "select_greedy": plan_select_greedy,
}


def load_source(spec: KernelSpec | str) -> str:
    """The body text of a kernel: package data in ``dflash2_mlx/kernels/metal/``."""
    if isinstance(spec, str):
        spec = KERNEL_SPECS[spec]
    from importlib.resources import files

    resource = files("dflash2_mlx.kernels.metal").joinpath(spec.filename)
    if not resource.is_file():
        raise FileNotFoundError(
            f"Metal kernel source {spec.filename!r} is missing from dflash2_mlx/kernels/metal/: reinstall the package"
        )
    return resource.read_text(encoding="utf-8")
