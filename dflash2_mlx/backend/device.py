"""Which code paths run: the ones tuned for MLX's CPU backend, or the ones Apple GPUs take.

A few modules pick a path by device: the target runner (RoPE from a table, a host-built causal
mask, the Gated DeltaNet recurrence as our own op loop), the drafter's attention (polynomial exp)
and the row-major weight copies. Every GPU path has an MLX fallback on the CPU, so
``DFLASH2_MLX_PATHS=gpu`` makes the CPU take the GPU paths: the tests run them here (it is a
testing aid, slower on the CPU, and changes nothing that is generated). What cannot be forced is
the Metal hardware itself: ``mx.fast.metal_kernel`` launches and mlx-lm's Metal Gated DeltaNet
kernel (``gated_delta_update`` falls back to its ops on the CPU).
"""

from __future__ import annotations

import os

import mlx.core as mx

PATHS_ENV = "DFLASH2_MLX_PATHS"


def forced_gpu_paths() -> bool:
    """``DFLASH2_MLX_PATHS=gpu``: take the GPU code paths even on the CPU."""
    return os.environ.get(PATHS_ENV, "").strip().lower() == "gpu"


def cpu_paths() -> bool:
    """Whether the CPU-tuned paths run: on MLX's CPU device, unless the GPU paths are forced."""
    return mx.default_device() == mx.cpu and not forced_gpu_paths()


def metal_gpu() -> bool:
    """Whether the default device is a Metal GPU (custom kernels and mlx-lm's kernels run)."""
    try:
        return bool(mx.metal.is_available()) and mx.default_device() == mx.gpu
    except Exception:  # pragma: no cover - exotic builds without mx.metal
        return False


def backend() -> str:
    """"Metal", "CUDA" or "CPU": the backend of the default device."""
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "Metal"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return "CUDA"
    return "CPU"
