"""In which float type the drafter computes: its stored one, or float32 on GPUs without native bf16.

M1 and M2 GPUs emulate bf16. There, DFlash 2 drafters run in 16-bit activations lose their
acceptance (peers measured 0-6% on an M1 Max with a 4-bit drafter in 16-bit activations, 0.44x
plain decoding; the same weights with float32 activations, "w4a32", kept ~70% and ran 1.39x:
bstnxbt/dflash-mlx#60, z-lab/dflash#160, jundot/omlx#2907). So on those chips the drafter runs
in float32:

- its unquantized parameters (norms, convolutions, codebooks, dense projections) become float32;
- a quantized drafter keeps its 4/8-bit weights and computes with float32 scales, biases and
  activations (w4a32 / w8a32);
- the target's embeddings and tapped features enter it as float32 (``Drafter.__call__``,
  ``Drafter.absorb``);
- its hidden rows go through the target's LM head in the head's own dtype (the head's weight is
  the target's, often 4-bit: running it in float32 would upcast a vocabulary-sized matrix per
  draft) and the logits come back as float32 for the candidate selector.

``DFLASH2_MLX_DRAFTER_ACTIVATIONS`` overrides the choice: ``float32`` forces the path on any
device (the CPU tests run it so), ``native`` keeps the stored dtype even on M1/M2.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash2_mlx.backend import device

ACTIVATIONS_ENV = "DFLASH2_MLX_DRAFTER_ACTIVATIONS"
SETTINGS = ("float32", "native")


@dataclass(frozen=True)
class ActivationChoice:
    """The drafter's activation dtype (None: the dtype it is stored in) and why."""

    dtype: Optional[mx.Dtype]
    reason: str


def activation_setting() -> Optional[str]:
    """``DFLASH2_MLX_DRAFTER_ACTIVATIONS`` as "float32" or "native", or None (decide by the chip).
    Raises ValueError with what to do for any other value."""
    value = os.environ.get(ACTIVATIONS_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in SETTINGS:
        raise ValueError(f"{ACTIVATIONS_ENV}={value!r} is not a setting; use float32, native or auto (or unset it)")
    return value


def choose_activations(architecture: Optional[str] = None) -> ActivationChoice:
    """The activation dtype drafters get on this machine (``architecture``: the GPU's, by default
    the one in use; see ``device.gpu_architecture``)."""
    setting = activation_setting()
    if setting == "float32":
        return ActivationChoice(mx.float32, f"{ACTIVATIONS_ENV}=float32 forces it")
    if setting == "native":
        return ActivationChoice(None, f"{ACTIVATIONS_ENV}=native forces it")
    architecture = device.gpu_architecture() if architecture is None else architecture
    if device.emulates_bf16(architecture):
        return ActivationChoice(mx.float32, f"{architecture} is an M1/M2-family GPU: no native bf16")
    if architecture.startswith("applegpu"):
        return ActivationChoice(None, f"{architecture} has native bf16")
    return ActivationChoice(None, f"not an M1/M2 GPU (backend {device.backend()})")


def apply_activations(drafter: nn.Module, choice: ActivationChoice) -> None:
    """Make ``drafter`` compute in ``choice.dtype``: its floating-point parameters cast (quantized
    weights stay packed: their scales and biases are cast) and ``activation_dtype`` set so that
    its inputs and logits are cast too. A None dtype leaves the drafter as stored."""
    if choice.dtype is not None:
        drafter.set_dtype(choice.dtype)  # floating parameters only (mlx's default predicate)
        mx.eval(drafter.parameters())
    drafter.activation_dtype = choice.dtype
    drafter.activation_reason = choice.reason


def stored_float_dtype(drafter: nn.Module) -> Optional[mx.Dtype]:
    """The dtype of the drafter's floating-point parameters (the first one found), or None."""
    for _, value in tree_flatten(drafter.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return None


def weight_bits(drafter: nn.Module) -> Optional[int]:
    """The bits of the drafter's quantized projections, or None when none is quantized."""
    bits = {m.bits for _, m in drafter.named_modules() if isinstance(m, nn.QuantizedLinear)}
    return max(bits) if bits else None


def describe(drafter: nn.Module) -> str:
    """How a loaded drafter computes, e.g. "w4a32 (4-bit weights, float32 activations); why:
    DFLASH2_MLX_DRAFTER_ACTIVATIONS=float32 forces it"."""
    dtype = stored_float_dtype(drafter)
    dtype_name = str(dtype).removeprefix("mlx.core.") if dtype is not None else "unknown"
    bits = weight_bits(drafter)
    activations = f"{dtype_name} activations"
    shape = f"w{bits}a{dtype.size * 8} ({bits}-bit weights, {activations})" if bits and dtype else activations
    reason = getattr(drafter, "activation_reason", None)
    return f"{shape}; why: {reason}" if reason else shape


def policy_line(architecture: Optional[str] = None) -> str:
    """One line for ``doctor``: which precision drafters will run in here, and why."""
    choice = choose_activations(architecture)
    override = "" if activation_setting() else f"; {ACTIVATIONS_ENV}=float32|native overrides"
    if choice.dtype is None:
        return f"runs in its stored dtype (a 4/8-bit drafter in its scales' dtype); why: {choice.reason}{override}"
    return (
        f"runs in float32 activations (16-bit weights upcast; 4/8-bit weights stay packed: w4a32/w8a32); "
        f"why: {choice.reason}{override}"
    )


def planned_drafter_memory(weight_bytes: int, shape, quantized: bool) -> tuple[int, object]:
    """(weight bytes, ``memory.DrafterShape``) a drafter stored in ``weight_bytes`` will occupy once
    loaded here, for the memory pre-flight: float32 activations double a 16-bit drafter's weights
    and the bytes of its context K/V rows; a quantized drafter's packed weights stay as they are
    (only its scales, biases and the few unquantized parts grow, left out of the estimate)."""
    if choose_activations().dtype is None or shape.kv_bytes >= 4:
        return weight_bytes, shape
    return (weight_bytes if quantized else 2 * weight_bytes), dataclasses.replace(shape, kv_bytes=4)
