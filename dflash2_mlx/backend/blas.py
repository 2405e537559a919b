"""An optimised BLAS for MLX's CPU matmuls on Linux, from pip alone.

MLX's Linux CPU wheel links a reference BLAS (netlib: a few GFLOP/s, and a matmul's cost grows
linearly with its rows, so an 8-row verify pass costs as much as eight one-row steps). Its
libmlx.so calls the standard unprefixed CBLAS and LAPACK symbols (``cblas_sgemm``, ``sgesdd_``,
...), which the dynamic linker binds to the first library in the process's global scope that
defines them. A BLAS loaded with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported therefore
takes those calls over; after that import it has no effect, which is why the package does it on
import.

Which BLAS, first found wins:

1. ``openblas``: the system OpenBLAS (Debian's libopenblas0-pthread), when installed.
2. ``mkl``: Intel oneMKL from the ``mkl`` wheel, a Linux dependency of this package, so
   ``pip install`` alone brings it (with its OpenMP runtime; nothing else from the system). Its
   ``libmkl_rt`` is found through the wheel's own file list, not a guessed path. The OpenBLAS
   wheels on the index are no use here: scipy-openblas prefixes every symbol (``scipy_cblas_sgemm``),
   and the unprefixed ones (cmeel-openblas, ngsolve-openblas) need the system's libgfortran.so.5.
3. ``reference``: MLX's own, when neither is there (``reference_blas_warning`` says what it costs).

Set ``DFLASH2_MLX_BLAS`` to ``openblas``, ``mkl`` or ``reference`` to pick one
(``DFLASH2_MLX_OPENBLAS=0``, the older switch, still means ``reference``).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Callable, Optional

CANDIDATES = ("libopenblas.so.0", "libopenblas.so")  # the system OpenBLAS, by soname
CHOICES = ("openblas", "mkl", "reference")

status = "not tried"
loaded: Optional[str] = None  # "openblas", "mkl", or None: MLX's reference BLAS
library_path: Optional[str] = None  # the file that was loaded


def _load_system_openblas() -> Optional[str]:
    for name in CANDIDATES:
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return defining_file(lib, "openblas_get_config") or name
    return None


def mkl_runtime_path() -> Optional[Path]:
    """libmkl_rt from the installed ``mkl`` distribution's file list, or None."""
    try:
        dist = importlib.metadata.distribution("mkl")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name.startswith("libmkl_rt.so"):
            path = Path(dist.locate_file(file)).resolve()
            if path.is_file():
                return path
    return None


MKL_THREADING_SEQUENTIAL = 1  # mkl_service.h


def _load_mkl() -> Optional[str]:
    path = mkl_runtime_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    if "MKL_THREADING_LAYER" not in os.environ:
        # MLX calls BLAS from its own stream threads; MKL's default OpenMP layer then spins
        # workers against them. Measured here (2 cores, bench --block-size 8): speculative
        # decoding at 4.5-9.5 tok/s threaded vs 102-122 sequential. Before any other MKL call.
        lib.MKL_Set_Threading_Layer(ctypes.c_int(MKL_THREADING_SEQUENTIAL))
    return str(path)


def defining_file(lib: ctypes.CDLL, symbol: str) -> Optional[str]:
    """The file that defines ``symbol`` as the dynamic linker resolves it through ``lib`` (dladdr);
    ``ctypes.CDLL(None)`` asks the process's global scope, where MLX's BLAS calls bind."""

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("fname", ctypes.c_char_p),
            ("fbase", ctypes.c_void_p),
            ("sname", ctypes.c_char_p),
            ("saddr", ctypes.c_void_p),
        ]

    try:
        dladdr = ctypes.CDLL(None).dladdr
        address = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p)
    except AttributeError:
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    info = DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.fname:
        return None
    return os.path.realpath(info.fname.decode())


LOADERS: dict[str, Callable[[], Optional[str]]] = {"openblas": _load_system_openblas, "mkl": _load_mkl}
NAMES = {"openblas": "OpenBLAS", "mkl": "Intel oneMKL"}


def _requested() -> Optional[str]:
    choice = os.environ.get("DFLASH2_MLX_BLAS", "").strip().lower()
    if not choice and os.environ.get("DFLASH2_MLX_OPENBLAS") == "0":
        return "reference"
    return choice or None


def preload() -> str:
    """Load the first available optimised BLAS globally; returns a one-line status for `doctor`."""
    global status, loaded, library_path
    choice = _requested()
    if not sys.platform.startswith("linux"):
        status = "not needed (not Linux)"
    elif "mlx.core" in sys.modules:
        status = "not loaded: mlx.core was imported first"
    elif choice is not None and choice not in CHOICES:
        status = f"MLX's reference BLAS: DFLASH2_MLX_BLAS={choice!r} is not one of {', '.join(CHOICES)}"
    elif choice == "reference":
        status = "MLX's reference BLAS (chosen by DFLASH2_MLX_BLAS / DFLASH2_MLX_OPENBLAS)"
    else:
        for name in (choice,) if choice else tuple(LOADERS):
            path = LOADERS[name]()
            if path is not None:
                loaded, library_path = name, path
                status = f"{NAMES[name]} ({path})"
                break
        else:
            missing = f"{NAMES[choice]} not found" if choice else "no optimised BLAS found"
            status = f"MLX's reference BLAS: {missing} (pip install mkl, or apt-get install libopenblas0-pthread)"
    return status


def set_threads(n: int) -> str:
    """Pin the loaded BLAS to ``n`` threads where it has its own pool; says what runs, for logs.

    Acts on the library ``preload`` loaded, not on whatever OpenBLAS happens to be installed."""
    if loaded == "openblas":
        try:
            ctypes.CDLL(library_path).openblas_set_num_threads(ctypes.c_int(n))
            return f"OpenBLAS threads = {n}"
        except (OSError, AttributeError):
            return "OpenBLAS: thread count not settable"
    if loaded == "mkl":
        return "oneMKL sequential (MLX's own threads call it)"
    return "MLX's reference BLAS (single-threaded)"


def reference_blas_warning() -> Optional[str]:
    """One line for commands that decode: set when MLX's CPU matmuls run on its reference BLAS."""
    if loaded is not None or not sys.platform.startswith("linux"):
        return None
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None
    return (
        "note: matmuls run on MLX's reference BLAS, where a verify pass of B tokens costs about B "
        "plain steps, so speculative decoding gains little; fix: pip install mkl (x86-64) or "
        "apt-get install libopenblas0-pthread"
    )


# Row-major weight copies: nn.Linear multiplies by a transposed view of its weight, and on the CPU
# OpenBLAS repacks that transposed operand on every multi-row matmul. Measured here with 8 rows:
# [256 -> 448] 109 -> 38 us, [448 -> 256] 113 -> 42 us, [256 -> 1024] 333 -> 182 us; a third of a
# verify pass's stream-thread time was that packing. The copies double the dense weights' memory,
# so they are kept for float32 weights on the CPU only, up to this many bytes in all.
# oneMKL multiplies the transposed views without that cost: measured here (same process,
# interleaved), copies made SmolLM2-135M's verify passes of 4 / 8 / 16 rows 21% / 22% / 13% slower
# and 2 rows 14-31% slower; on the embedded pair, target passes of 4..16 rows 1-6% faster but 2 rows
# 24% slower, its drafter's 8-row step 4% faster. So with oneMKL the views are kept.
ROW_MAJOR_COPIES_MAX_BYTES = 1 << 30


def transposed(weight, row_major: bool):
    """weight.T [in, out] for ``x @ weight.T``: a view (nn.Linear's own operand), or with
    ``row_major`` a row-major copy, which OpenBLAS multiplies without repacking."""
    import mlx.core as mx

    return mx.contiguous(weight.T) if row_major else weight.T


def row_major_copies_pay(weights) -> bool:
    """Whether multi-row matmuls should use row-major copies of these (dense) weights: float32
    on the CPU, within the memory bound, unless oneMKL runs the matmuls (see above)."""
    import mlx.core as mx  # not at module level: OpenBLAS must be loaded before mlx.core

    from dflash2_mlx.backend import device

    weights = list(weights)
    return (
        device.cpu_paths()
        and loaded != "mkl"
        and bool(weights)
        and all(w.dtype == mx.float32 for w in weights)
        and sum(w.nbytes for w in weights) <= ROW_MAJOR_COPIES_MAX_BYTES
    )
