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
import re
from typing import Optional

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
    """ "Metal", "CUDA" or "CPU": the backend of the default device."""
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "Metal"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return "CUDA"
    return "CPU"


# Apple GPU generations whose bf16 is emulated (no native bf16 arithmetic): M1 (g13) and M2 (g14).
# M3 is g15, M4 g16, M5 g17.
BF16_EMULATED_GENERATIONS = (13, 14)


def gpu_architecture() -> str:
    """The Metal GPU's architecture name as MLX reports it (``mx.device_info()["architecture"]``,
    e.g. "applegpu_g13s" on an M1 Max), or "" when the default device is not a Metal GPU.

    MLX reads it from ``MTLDevice.architecture.name`` (mlx/backend/metal/device_info.cpp) and
    takes its generation, the number after "applegpu_g", for its own kernel choices
    (``Device::get_architecture_gen``: e.g. qmv_wide only from gen 15 on). On the CPU backend
    the same key holds the CPU's ("x86_64", "arm64")."""
    if not metal_gpu():
        return ""
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return str(info.get("architecture", ""))


def gpu_generation(architecture: str) -> Optional[int]:
    """The Apple GPU generation in an architecture name ("applegpu_g13s" -> 13), or None."""
    found = re.match(r"applegpu_g(\d+)", architecture)
    return int(found.group(1)) if found else None


def emulates_bf16(architecture: Optional[str] = None) -> bool:
    """Whether the GPU (by default the one in use) has no native bf16: M1 and M2 GPUs run bf16
    as emulated float32 arithmetic, and 16-bit drafters lose their acceptance there (peers report
    0-6% for a DFlash 2 drafter in 16-bit activations on an M1 Max, ~70% in float32)."""
    generation = gpu_generation(gpu_architecture() if architecture is None else architecture)
    return generation in BF16_EMULATED_GENERATIONS
