"""Use OpenBLAS for MLX's CPU matmuls on Linux when it is installed.

MLX's Linux CPU wheel links a reference BLAS (a few GFLOP/s); loading OpenBLAS into the process
before ``mlx.core`` is first imported makes float32 matmuls about 35x faster (measured here:
4.5 -> 157 GFLOP/s at 512x512). It must happen before that import or it has no effect, which is
why the package does it on import. Set DFLASH2_MLX_OPENBLAS=0 to keep MLX's own BLAS.
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = ("libopenblas.so.0", "libopenblas.so")

status = "not tried"


def preload() -> str:
    """Load OpenBLAS globally if possible; returns a one-line status for `doctor`."""
    global status
    if not sys.platform.startswith("linux"):
        status = "not needed (not Linux)"
    elif os.environ.get("DFLASH2_MLX_OPENBLAS", "1") == "0":
        status = "disabled by DFLASH2_MLX_OPENBLAS=0"
    elif "mlx.core" in sys.modules:
        status = "not loaded: mlx.core was imported first"
    else:
        for name in CANDIDATES:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                status = f"OpenBLAS ({name})"
                break
            except OSError:
                continue
        else:
            status = "not found (apt-get install libopenblas0-pthread for fast CPU matmuls)"
    return status


# Row-major weight copies: nn.Linear multiplies by a transposed view of its weight, and on the CPU
# OpenBLAS repacks that transposed operand on every multi-row matmul. Measured here with 8 rows:
# [256 -> 448] 109 -> 38 us, [448 -> 256] 113 -> 42 us, [256 -> 1024] 333 -> 182 us; a third of a
# verify pass's stream-thread time was that packing. The copies double the dense weights' memory,
# so they are kept for float32 weights on the CPU only, up to this many bytes in all.
ROW_MAJOR_COPIES_MAX_BYTES = 1 << 30


def transposed(weight, row_major: bool):
    """weight.T [in, out] for ``x @ weight.T``: a view (nn.Linear's own operand), or with
    ``row_major`` a row-major copy, which OpenBLAS multiplies without repacking."""
    import mlx.core as mx

    return mx.contiguous(weight.T) if row_major else weight.T


def row_major_copies_pay(weights) -> bool:
    """Whether multi-row matmuls should use row-major copies of these (dense) weights."""
    import mlx.core as mx  # not at module level: OpenBLAS must be loaded before mlx.core

    from . import device

    weights = list(weights)
    return (
        device.cpu_paths()
        and bool(weights)
        and all(w.dtype == mx.float32 for w in weights)
        and sum(w.nbytes for w in weights) <= ROW_MAJOR_COPIES_MAX_BYTES
    )
