"""`dflash2-mlx convert`: a Hugging Face checkpoint to an MLX directory this project loads.

Targets go through mlx-lm's own conversion (``mlx_lm.convert``: sanitize, optional quantization,
save). Drafters are never loaded through mlx-lm (they say ``model_type: qwen3`` but are not Qwen3
models): they are read with ``loading.load_drafter``, their linear layers quantized (8-bit by
default), and the codebooks, convolutions (base kernels and their dynamic kernel projections),
the selector's hidden projection and the norms kept in bf16: 4-bit drafters have been reported
to collapse acceptance.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from dflash2_mlx.cli.common import fail

DTYPES = ("bfloat16", "float16", "float32")
# Drafter modules kept unquantized (besides norms and plain arrays, which are never quantized):
# the dynamic convolutions' kernel projections and the candidate selector.
KEEP_UNQUANTIZED = ("kernel_projection", "candidate_selector")


def drafter_quant_predicate(group_size: int):
    """Which drafter modules get quantized: the big linears (fc, attention and MLP projections)."""

    def predicate(path: str, module) -> bool:
        if not hasattr(module, "to_quantized"):
            return False
        if any(part in path for part in KEEP_UNQUANTIZED):
            return False
        return module.weight.shape[-1] % group_size == 0

    return predicate


def convert_drafter(src: Path, out: Path, quantize: bool, bits: int, group_size: int, dtype: str) -> dict:
    """Write an MLX drafter directory: safetensors + config.json with a `quantization` entry."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map

    from dflash2_mlx.models.drafter_precision import ActivationChoice
    from dflash2_mlx.models.loading import load_drafter

    drafter = load_drafter(str(src), ActivationChoice(None, "as stored, for conversion"))
    target_dtype = getattr(mx, dtype)
    drafter.update(
        tree_map(lambda p: p.astype(target_dtype) if mx.issubdtype(p.dtype, mx.floating) else p, drafter.parameters())
    )
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization", None)
    raw.pop("quantization_config", None)
    if quantize:
        nn.quantize(drafter, group_size, bits, class_predicate=drafter_quant_predicate(group_size))
        raw["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
        raw["quantization_config"] = dict(raw["quantization"])
    raw["dtype"] = dtype
    raw.pop("torch_dtype", None)
    weights = dict(tree_flatten(drafter.parameters()))
    mx.eval(list(weights.values()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for extra in ("README.md", "LICENSE", "generation_config.json"):
        if (src / extra).exists() and not (out / extra).exists():
            (out / extra).write_bytes((src / extra).read_bytes())
    quantized = sorted({k.rsplit(".", 1)[0] for k in weights if k.endswith(".scales")})
    return {
        "tensors": len(weights),
        "quantized_modules": len(quantized),
        "bytes": sum(v.nbytes for v in weights.values()),
    }


def drafter_warnings(quantize: bool, bits: int, dtype: str) -> list[str]:
    """One line per drafter format known to collapse acceptance, each naming the safer choice.

    4-bit drafter weights collapse acceptance on some Macs (8-bit keeps it). float16 drafters
    overflow in 16-bit activations: peers measured NaN draft logits and 0% acceptance for DFlash 2
    drafters cast to float16 on M1/M2 (jundot/omlx#2907, bstnxbt/dflash-mlx#60). bfloat16 keeps
    the range, and M1/M2 run every drafter in float32 activations anyway (``drafter_precision``).
    """
    warnings = []
    if quantize and bits == 4:
        warnings.append(
            "4-bit drafters are known to collapse acceptance on some Macs; --q-bits 8 (the default) keeps it"
        )
    if dtype == "float16":
        warnings.append(
            "float16 drafters are known to collapse acceptance (16-bit activations overflow to NaN "
            "draft logits); --dtype bfloat16 (the default) keeps it"
        )
    return warnings


def is_drafter_config(config: dict) -> bool:
    from dflash2_mlx.models.drafter_config import ARCHITECTURES

    return "dflash_config" in config or bool(set(config.get("architectures") or ()) & set(ARCHITECTURES))


def convert_command(
    hf_path: str = typer.Option(..., "--hf-path", help="Source checkpoint: local directory or Hugging Face repo id."),
    out: Path = typer.Option(..., "--out", help="Output directory (must not exist, or be empty)."),
    quantize: Optional[bool] = typer.Option(
        None,
        "--quantize/--no-quantize",
        help="Quantize the linear layers. Default: off for a target, on (8-bit) for a drafter.",
    ),
    q_bits: Optional[int] = typer.Option(
        None, "--q-bits", help="Bits per weight, 4 or 8. Default: 4 for a target, 8 for a drafter."
    ),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Weights sharing one scale and bias: 32, 64 or 128."),
    draft: bool = typer.Option(
        False, "--draft", help="The source is a DFlash / DFlash 2 drafter (detected from its config.json anyway)."
    ),
    dtype: Optional[str] = typer.Option(
        None,
        "--dtype",
        help="Float type of what is not quantized: bfloat16, float16 or float32. Default: the checkpoint's for a target, bfloat16 for a drafter (M1/M2 GPUs run drafters in float32 activations; float16 drafters collapse).",
    ),
) -> None:
    """Convert a Hugging Face checkpoint (target or drafter) to MLX, optionally quantized.

    A target goes through mlx-lm's conversion (weights sanitized, optional 4/8-bit quantization,
    tokenizer copied). A drafter (--draft, or a config.json with DFlash architectures) gets its
    linear layers quantized to 8 bits by default while its codebooks, convolutions and norms stay
    in bf16 (4-bit drafters are reported to collapse acceptance). The output is checked by
    loading it back with dflash2-mlx's own loaders.
    """
    from dflash2_mlx.models.loading import LoadError, _read_json, load_drafter, load_target, resolve

    if q_bits is not None and q_bits not in (4, 8):
        fail(f"--q-bits must be 4 or 8, got {q_bits}")
    if q_group_size not in (32, 64, 128):
        fail(f"--q-group-size must be 32, 64 or 128, got {q_group_size}")
    if dtype is not None and dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    if q_bits is not None and quantize is False:
        fail("--q-bits given with --no-quantize: drop one of them")
    out = out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"output {out} already exists and is not an empty directory; pick a new --out")
    src = resolve(hf_path, "draft model" if draft else "model")
    config = _read_json(src / "config.json")
    is_drafter = is_drafter_config(config)
    if draft and not is_drafter:
        fail(f"--draft given but {src} is not a DFlash drafter (architectures {config.get('architectures')})")
    err = sys.stderr
    if is_drafter:
        quantize = True if quantize is None else quantize
        bits = q_bits or 8
        for warning in drafter_warnings(quantize, bits, dtype or "bfloat16"):
            print(f"warning: {warning}", file=err)
        if out.exists():
            out.rmdir()
        info = convert_drafter(src, out, quantize, bits, q_group_size, dtype or "bfloat16")
        load_drafter(str(out))  # the output must load with the project's own loader
        kind = (
            (
                f"drafter, {info['quantized_modules']} linear layers {bits}-bit (group {q_group_size}), "
                f"codebooks/convs/norms {dtype or 'bfloat16'}"
            )
            if quantize
            else f"drafter, {dtype or 'bfloat16'}"
        )
        size = info["bytes"]
    else:
        from mlx_lm.convert import convert

        quantize = bool(quantize)
        bits = q_bits or 4
        if out.exists():
            out.rmdir()
        try:
            with contextlib.redirect_stdout(err):
                convert(
                    str(src),
                    str(out),
                    quantize=quantize,
                    q_group_size=q_group_size if quantize else None,
                    q_bits=bits if quantize else None,
                    dtype=dtype,
                )
        except (ValueError, KeyError) as e:
            raise LoadError(f"mlx-lm cannot convert {src}: {' '.join(str(e).split())[:200]}") from None
        load_target(str(out))
        kind = f"target, {bits}-bit (group {q_group_size})" if quantize else f"target, {dtype or 'checkpoint dtype'}"
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({kind}; {size / 2**20:.1f} MiB of weights); it loads with dflash2-mlx")
