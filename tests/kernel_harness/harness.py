"""CPU harness for the Metal kernel bodies in ``metal/`` (test-only).

No machine that runs the tests has Metal, so each ``mx.fast.metal_kernel`` body is compiled with
the system C++ compiler (g++) and run on the CPU:

1. :func:`generate` writes a C++ translation unit: ``shim.h`` (Metal types and functions) and
   ``runtime.h`` (the grid launcher), the kernel's header (as given to ``mx.fast.metal_kernel``),
   then a function whose parameter list mirrors the signature MLX generates
   (mlx/backend/metal/custom_kernel.cpp ``write_signature``) -- inputs as ``const constant T*``
   when they have fewer than 8 elements, else ``const device T*``, 0-d inputs by reference,
   ``name_shape`` / ``name_strides`` / ``name_ndim`` only when the body mentions them, outputs as
   ``device T*``, template parameters from ``template=`` and the thread-position attributes the
   body mentions -- and whose body is the EXACT text of the ``.metal`` file;
2. the unit is compiled into a shared library, cached under the temp dir by a hash of its text;
3. :func:`run` takes a :class:`dflash2_mlx.kernels.plans.Plan` -- the same launch description the
   Metal path passes to ``mx.fast.metal_kernel`` (inputs, template, grid, threadgroup, output
   shapes and dtypes) -- makes the inputs row-contiguous (``ensure_row_contiguous=True``), fills
   the outputs with a 0xFF poison pattern (NaN for floats, -1 for int32) unless ``init_value``
   is given, runs every thread of the grid, checks guard bytes after each output (an
   out-of-bounds write fails the run) and returns the outputs as mx arrays.

:func:`two_tap_conv` and :func:`select_greedy` have the signatures of the public functions in
``dflash2_mlx.kernels.dispatch`` and can be installed with ``kernels.override(**harness_kernels())``.
What the harness cannot model: the Metal compiler and
its math library (exp accuracy, contraction into fma), bf16 emulation on M1/M2 GPUs, SIMD-group
functions and threadgroup memory (bodies using them do not compile here). On a Mac every kernel
also checks itself against the reference the first time it is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from dflash2_mlx.kernels import plans, reference

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim.h"
RUNTIME = HERE / "runtime.h"
CXXFLAGS = (
    "-std=c++17",
    "-O2",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fPIC",
    "-shared",
    "-Wall",
    "-Wno-unused-variable",
    "-Wno-unused-but-set-variable",
)
MAX_CONSTANT_ARRAY_SIZE = 8  # custom_kernel.cpp: inputs with fewer elements are `constant`
GUARD_BYTES = 64
POISON = 0xFF

# mlx get_type_string
TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
}

# The attributes MLX adds to the signature when the body mentions them, in MLX's order.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)


class HarnessError(RuntimeError):
    """The harness could not compile or run a kernel body (or the run broke a rule)."""


# ---------------------------------------------------------------------------------------------
# Code generation
# ---------------------------------------------------------------------------------------------


def _type_string(dtype: mx.Dtype) -> str:
    try:
        return TYPE_STRINGS[dtype]
    except KeyError:
        raise HarnessError(f"dtype {dtype} is not supported by the kernel harness") from None


def _template_value(value) -> tuple[str, str]:
    if isinstance(value, bool):
        return "bool", "true" if value else "false"
    if isinstance(value, int):
        return "int", str(int(value))
    if isinstance(value, mx.Dtype):
        return "typename", _type_string(value)
    raise HarnessError(f"template argument {value!r} must be an mx.Dtype, int or bool")


def function_name(spec: plans.KernelSpec, template: Sequence[tuple[str, object]]) -> str:
    """The kernel function name MLX generates (``custom_kernel_<name>[_<template hash>]``)."""
    name = "custom_kernel_" + spec.name
    if template:
        definition = "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"
        name += "_" + re.sub(r"<|>|(, )", "_", definition)[:-1]
    return re.sub(r"[^0-9A-Za-z_]", "_", name)


@dataclass
class _Param:
    kind: str  # "input", "shape", "strides", "ndim", "output"
    index: int  # input/output index
    ctype: str  # element type
    by_ref: bool = False


def generate(
    spec: plans.KernelSpec,
    body: str,
    inputs: Sequence[mx.array],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, object]],
    source_label: str = "kernel.metal",
) -> tuple[str, list[_Param], bool]:
    """C++ source for one kernel instantiation: (text, parameter list, uses barriers)."""
    if len(inputs) != len(spec.input_names):
        raise HarnessError(f"{spec.name}: expected {len(spec.input_names)} inputs, got {len(inputs)}")
    if len(output_dtypes) != len(spec.output_names):
        raise HarnessError(f"{spec.name}: expected {len(spec.output_names)} outputs")
    fname = function_name(spec, template)
    params: list[_Param] = []
    decls: list[str] = []
    for i, (name, arr) in enumerate(zip(spec.input_names, inputs)):
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        ctype = _type_string(arr.dtype)
        decls.append(f"  const {location} {ctype}{ref} {name}")
        params.append(_Param("input", i, ctype, by_ref=arr.ndim == 0))
        if arr.ndim > 0:
            if f"{name}_shape" in body:
                decls.append(f"  const constant int* {name}_shape")
                params.append(_Param("shape", i, "int"))
            if f"{name}_strides" in body:
                decls.append(f"  const constant int64_t* {name}_strides")
                params.append(_Param("strides", i, "int64_t"))
            if f"{name}_ndim" in body:
                decls.append(f"  const constant int& {name}_ndim")
                params.append(_Param("ndim", i, "int", by_ref=True))
    for j, (name, dtype) in enumerate(zip(spec.output_names, output_dtypes)):
        ctype = _type_string(dtype)
        decls.append(f"  device {ctype}* {name}")
        params.append(_Param("output", j, ctype))
    attributes = [(a, t) for a, t in METAL_ATTRIBUTES if a in body]
    decls += [f"  {t} {a}" for a, t in attributes]

    tmpl_decl = ""
    tmpl_inst = ""
    if template:
        kinds = [_template_value(v) for _, v in template]
        tmpl_decl = "template <" + ", ".join(f"{k} {n}" for (n, _), (k, _) in zip(template, kinds)) + ">\n"
        tmpl_inst = "<" + ", ".join(v for _, v in kinds) + ">"

    args = []
    for k, p in enumerate(params):
        const = "" if p.kind == "output" else "const "
        if p.by_ref:
            args.append(f"*({const}{p.ctype}*)args[{k}]")
        else:
            args.append(f"({const}{p.ctype}*)args[{k}]")
    args += [f"ti.{a}" for a, _ in attributes]
    uses_barrier = "threadgroup_barrier" in body
    label = source_label.replace("\\", "/").replace('"', "")
    text = "\n".join(
        [
            '#include "shim.h"',
            '#include "runtime.h"',
            spec.header,
            f"{tmpl_decl}void {fname}(",
            ",\n".join(decls) + ") {",
            f'#line 1 "{label}"',
            body,
            "}",
            '#line 10000 "harness_launcher.cpp"',
            'extern "C" int dflash2_launch(void** args, const unsigned* grid, const unsigned* group,',
            "                              int reverse) {",
            "  const dflash2_harness::Body body = [&](const dflash2_harness::ThreadInfo& ti) {",
            "    (void)ti;",
            f"    {fname}{tmpl_inst}(" + ", ".join(args) + ");",
            "  };",
            f"  return dflash2_harness::launch(grid, group, reverse, {str(uses_barrier).lower()}, body);",
            "}",
            'extern "C" const char* dflash2_error() { return dflash2_harness::g_error.c_str(); }',
            "",
        ]
    )
    return text, params, uses_barrier


# ---------------------------------------------------------------------------------------------
# Compilation
# ---------------------------------------------------------------------------------------------

_LOCK = threading.RLock()
_LIBS: dict[str, ctypes.CDLL] = {}


def find_compiler() -> str:
    """The C++ compiler ($CXX or g++); a clear error when there is none."""
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise HarnessError(
            f"the kernel harness needs a C++ compiler ({cxx!r} not found on PATH): it compiles the "
            "Metal kernel bodies in metal/ with g++ to test them without a Mac. "
            "Install it (Debian/Ubuntu: apt-get install g++) or set CXX."
        )
    return path


def cache_dir() -> Path:
    root = os.environ.get("DFLASH2_KERNEL_HARNESS_CACHE") or tempfile.gettempdir()
    path = Path(root) / "dflash2_mlx_kernel_harness"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(text: str) -> ctypes.CDLL:
    """Compile (or fetch from the cache) the shared library for a generated unit."""
    cxx = find_compiler()
    shim = SHIM.read_text()
    runtime = RUNTIME.read_text()
    # `constant` and `device` are empty macros in the shim: units that differ only in them
    # (an input below or above 8 elements) compile to the same library.
    normalized = re.sub(r"\bconst (constant|device) ", "const ", text)
    key = hashlib.sha256("\0".join([normalized, shim, runtime, cxx, " ".join(CXXFLAGS)]).encode()).hexdigest()[:24]
    with _LOCK:
        lib = _LIBS.get(key)
        if lib is not None:
            return lib
        directory = cache_dir()
        so = directory / f"k_{key}.so"
        if not so.exists():
            src = directory / f"k_{key}.cpp"
            src.write_text(text)
            tmp = directory / f"k_{key}.{os.getpid()}.{threading.get_ident()}.so"
            cmd = [cxx, *CXXFLAGS, "-I", str(HERE), "-o", str(tmp), str(src)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise HarnessError(f"compiling the kernel body failed ({' '.join(cmd)}):\n{proc.stderr[-6000:]}")
            os.replace(tmp, so)
        lib = ctypes.CDLL(str(so))
        lib.dflash2_launch.restype = ctypes.c_int
        lib.dflash2_launch.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.c_int,
        ]
        lib.dflash2_error.restype = ctypes.c_char_p
        _LIBS[key] = lib
        return lib


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

_NP_STORAGE = {
    mx.bfloat16: np.uint16,  # numpy has no bfloat16: pass the raw bits
    mx.float16: np.float16,
    mx.float32: np.float32,
    mx.int32: np.int32,
    mx.uint32: np.uint32,
    mx.int64: np.int64,
    mx.uint64: np.uint64,
    mx.int16: np.int16,
    mx.uint16: np.uint16,
    mx.int8: np.int8,
    mx.uint8: np.uint8,
    mx.bool_: np.bool_,
}


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    out = np.ascontiguousarray(np.array(a))  # ensure_row_contiguous
    expected = np.dtype(_NP_STORAGE[a.dtype])
    if out.dtype != expected:
        raise HarnessError(f"unexpected numpy storage {out.dtype} for {a.dtype}")
    return out


def _to_mlx(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


def run(
    plan: plans.Plan,
    *,
    source: str | None = None,
    reverse: bool = False,
    spec: plans.KernelSpec | None = None,
) -> list[mx.array]:
    """Run a launch plan through the compiled body; ``source`` replaces the kernel's body text
    (to test the harness itself), ``reverse`` runs threadgroups and threads in reverse order,
    ``spec`` describes a kernel that is not one of dflash2_mlx.kernels.plans.KERNEL_SPECS (then
    ``source`` is required)."""
    if spec is None:
        spec = plan.spec
    elif source is None:
        raise HarnessError("a custom spec needs its body text (source=...)")
    body = plans.load_source(spec) if source is None else source
    text, params, _ = generate(
        spec,
        body,
        plan.inputs,
        plan.output_dtypes,
        plan.template,
        source_label=f"metal/{spec.filename}" if source is None else f"modified/{spec.filename}",
    )
    lib = build(text)

    in_np = [_to_numpy(a) for a in plan.inputs]
    outs_raw: list[np.ndarray] = []
    outs_view: list[np.ndarray] = []
    for shape, dtype in zip(plan.output_shapes, plan.output_dtypes):
        storage = np.dtype(_NP_STORAGE[dtype])
        count = int(np.prod(shape, dtype=np.int64))
        raw = np.full(count * storage.itemsize + GUARD_BYTES, POISON, dtype=np.uint8)
        view = raw[: count * storage.itemsize].view(storage).reshape(shape)
        if plan.init_value is not None:
            if dtype == mx.bfloat16:
                view[...] = np.array(mx.array(plan.init_value, mx.bfloat16).view(mx.uint16))
            else:
                view[...] = plan.init_value
        outs_raw.append(raw)
        outs_view.append(view)

    keep: list[np.ndarray] = []
    pointers: list[int] = []
    for p in params:
        if p.kind == "input":
            buf = in_np[p.index]
        elif p.kind == "shape":
            buf = np.array(in_np[p.index].shape, dtype=np.int32)
        elif p.kind == "strides":
            arr = in_np[p.index]
            buf = np.array([s // arr.itemsize for s in arr.strides], dtype=np.int64)
        elif p.kind == "ndim":
            buf = np.array(in_np[p.index].ndim, dtype=np.int32)
        else:
            buf = outs_raw[p.index]
        if buf.size == 0:
            buf = np.zeros(1, dtype=np.uint8)  # a valid pointer for empty inputs
        keep.append(buf)
        pointers.append(buf.ctypes.data)

    args = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
    grid = (ctypes.c_uint * 3)(*plan.grid)
    group = (ctypes.c_uint * 3)(*plan.threadgroup)
    with _LOCK:
        status = lib.dflash2_launch(args, grid, group, 1 if reverse else 0)
        error = lib.dflash2_error().decode()
    if status != 0:
        raise HarnessError(f"{spec.name}: {error}")
    for name, raw, view in zip(spec.output_names, outs_raw, outs_view):
        if not np.all(raw[view.nbytes :] == POISON):
            raise HarnessError(f"{spec.name}: out-of-bounds write past the end of output {name!r}")
    return [_to_mlx(v, d) for v, d in zip(outs_view, plan.output_dtypes)]


def run_kernel(name: str, *args, source: str | None = None, reverse: bool = False):
    """The public kernel function ``name`` of dflash2_mlx.kernels.dispatch with the harness in place of
    Metal: same planning (unsupported shapes go to the reference ops, as on a Mac), same
    post-processing of the outputs."""
    plan = plans.PLANNERS[name](*args)
    if plan is None:
        return reference.REFERENCES[name](*args)
    return plan.finish(run(plan, source=source, reverse=reverse))


def run_plan_outputs(name: str, *args, source: str | None = None, reverse: bool = False):
    """Raw kernel outputs (including the pair kernels' score scratch) for a call."""
    plan = plans.PLANNERS[name](*args)
    if plan is None:
        raise HarnessError(f"{name}: these arguments are not supported by the kernel")
    return run(plan, source=source, reverse=reverse)


def two_tap_conv(x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
    return run_kernel("two_tap_conv", x, dynamic, base)


def select_greedy(anchor, candidates, unary, hidden, predecessor_codebook, successor_codebook):
    return run_kernel(
        "select_greedy",
        anchor,
        candidates,
        unary,
        hidden,
        predecessor_codebook,
        successor_codebook,
    )


def harness_kernels(*, sources: dict[str, str] | None = None, reverse: bool = False) -> dict[str, Callable]:
    """Keyword arguments for ``kernels.override``: every public kernel through the harness
    (optionally with replaced body texts, keyed by kernel name)."""
    sources = sources or {}

    def make(name):
        def fn(*args):
            return run_kernel(name, *args, source=sources.get(name), reverse=reverse)

        fn.__name__ = f"harness_{name}"
        return fn

    return {name: make(name) for name in reference.KERNEL_NAMES}


# ---------------------------------------------------------------------------------------------
# Comparison helpers (shared by the tests; each returns a list of problems, empty when equal)
# ---------------------------------------------------------------------------------------------

CONV_TOLERANCE = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 1e-2}


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def compare_conv(got: mx.array, x: mx.array, dynamic: mx.array, base: mx.array) -> list[str]:
    """The kernel's conv output against the reference: same shape and dtype as the reference;
    max abs error vs the float32 reference (on the same, already rounded inputs) within 1e-5
    (float32) or 1e-2 (float16/bfloat16), scaled by max(1, max |reference|)."""
    problems = []
    want = reference.reference_two_tap_conv(x, dynamic, base)
    want32 = reference.reference_two_tap_conv(x.astype(mx.float32), dynamic.astype(mx.float32), base.astype(mx.float32))
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return [f"shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}"]
    g, w32 = _f32(got), np.array(want32)
    scale = max(1.0, float(np.max(np.abs(w32))) if w32.size else 1.0)
    err = float(np.max(np.abs(g - w32))) if g.size else 0.0
    tol = CONV_TOLERANCE[x.dtype] * scale
    if not np.isfinite(err) or err > tol:
        problems.append(f"max abs error {err:.3g} > {tol:.3g} (dtype {x.dtype})")
    return problems


def compare_paths(got: mx.array, want: mx.array) -> list[str]:
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return [f"path shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}"]
    g, w = np.array(got), np.array(want)
    if not np.array_equal(g, w):
        where = np.argwhere(g != w)[:5].tolist()
        return [f"paths differ at {where}: got {g[tuple(where[0])]} want {w[tuple(where[0])]}"]
    return []
