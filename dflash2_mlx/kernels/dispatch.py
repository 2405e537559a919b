"""What callers use: the kernel functions, routed to an override, a fused Metal kernel or the reference.

The public functions ``two_tap_conv`` and ``select_greedy`` (specified in ``reference.py``)
run, in order of precedence:

1. an implementation installed with :func:`override` (tests route the engine through the CPU
   harness that compiles the ``.metal`` bodies with g++);
2. the reference ops when ``DFLASH2_MLX_KERNELS=reference`` is set;
3. the fused Metal kernel when ``mx.metal.is_available()`` and the default device is the GPU (as
   mlx-lm's gated-delta code decides), the call's shapes are supported (two taps, ...; see
   ``plans.py``), and the kernel passed its self-check for every float dtype among the call's
   inputs: once per kernel and dtype it is compared at the real launch widths with the reference
   computed on the CPU stream (``selfcheck.check_kernel``); if it fails to build or disagrees, a
   warning is issued and that kernel uses the reference ops for that dtype from then on;
4. the reference ops otherwise.

The decision is taken when the function is called, so inside ``mx.compile`` it is frozen at trace
time: :func:`prepare` runs the self-checks for the dtypes a model uses eagerly (at load, and in
:func:`compiled` before each trace), never inside a trace. This module also holds the dispatch
state (built kernels, self-check verdicts, overrides) and reports it for ``doctor``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import mlx.core as mx

from dflash2_mlx.kernels.plans import FLOAT_DTYPES, KERNEL_SPECS, PLANNERS, Plan, load_source
from dflash2_mlx.kernels.reference import KERNEL_NAMES, REFERENCES
from dflash2_mlx.kernels.selfcheck import check_kernel

__all__ = [
    "ENV_VAR",
    "active_kernels",
    "compiled",
    "disabled_kernels",
    "float_dtypes",
    "overridden",
    "override",
    "prepare",
    "select_greedy",
    "self_checks",
    "two_tap_conv",
]

ENV_VAR = "DFLASH2_MLX_KERNELS"


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


def _plan_dtypes(plan: Plan) -> list[mx.Dtype]:
    """The float dtypes among a launch's inputs (each must have passed its self-check)."""
    seen = []
    for a in plan.inputs:
        if a.dtype in FLOAT_DTYPES and a.dtype not in seen:
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


@contextlib.contextmanager
def override(
    *,
    two_tap_conv: Callable | None = None,
    select_greedy: Callable | None = None,
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
                if dtype in FLOAT_DTYPES:
                    _self_check(name, dtype)
    return active_kernels()


def float_dtypes(tree) -> list[mx.Dtype]:
    """The float dtypes of the arrays in a parameter tree (what a model's kernels will see),
    plus float32 (logits, scores)."""
    from mlx.utils import tree_flatten

    found = [mx.float32]
    for _, a in tree_flatten(tree):
        if isinstance(a, mx.array) and a.dtype in FLOAT_DTYPES and a.dtype not in found:
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
