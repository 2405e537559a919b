"""Memory: what a target + drafter pair needs at a context length, what the machine has, the
pre-flight that refuses a pair that cannot fit (before any download or load), and the wired limit.

Needs: the weights as stored (safetensors sizes: the files of a local directory, the Hub's file
sizes for a repo id, or a preset's recorded facts; no weight is downloaded), plus the caches of
one sequence at the context: attention KV (K and V per attention layer), the Gated DeltaNet
states (float32 recurrent state and conv window per layer, fixed size), the per-step states a
verify pass keeps where rollback keeps them, and the drafter's context K/V (bounded by its
sliding window).

Has: on a Mac, the GPU's recommended working set (``mx.device_info()``'s
``max_recommended_working_set_size``, the wired limit mlx-lm sets); elsewhere the physical
memory. ``DFLASH2_MLX_MEMORY_GB`` overrides it (tests, and users who know better).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

from dflash2_mlx.models.shapes import GB, DrafterShape, TargetShape

MEMORY_ENV = "DFLASH2_MLX_MEMORY_GB"
# Planning context when a command asks for none (serve --max-context sets it): a long chat.
DEFAULT_CONTEXT = 32768
# Activations, the prefill's temporaries, MLX's buffer cache: a margin on top of the estimate.
HEADROOM = 1.10


@dataclass
class MemoryPlan:
    """What a pair needs at a context length, in bytes, by part."""

    context: int
    target_weights: int
    drafter_weights: int
    kv_cache: int
    gdn_states: int
    verify_states: int
    drafter_context: int

    @property
    def total(self) -> int:
        return (
            self.target_weights
            + self.drafter_weights
            + self.kv_cache
            + self.gdn_states
            + self.verify_states
            + self.drafter_context
        )

    @property
    def needed(self) -> int:
        """The total with the margin for activations and MLX's buffer cache."""
        return int(self.total * HEADROOM)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "needed_with_headroom": self.needed}


def plan(
    target: TargetShape,
    target_weights: int,
    drafter: Optional[DrafterShape],
    drafter_weights: int,
    context: int,
    keeps_verify_states: bool,
) -> MemoryPlan:
    """The memory a pair needs for one sequence of ``context`` tokens."""
    return MemoryPlan(
        context=context,
        target_weights=target_weights,
        drafter_weights=drafter_weights if drafter else 0,
        kv_cache=target.kv_bytes_at(context),
        gdn_states=target.gdn_state_bytes(),
        verify_states=target.kept_verify_bytes() if (drafter and keeps_verify_states) else 0,
        drafter_context=drafter.context_bytes_at(context) if drafter else 0,
    )


# ---------------------------------------------------------------------------------------------
# What the machine has


def available_bytes() -> tuple[int, str]:
    """(bytes the models may use, where the figure comes from)."""
    override = os.environ.get(MEMORY_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            raise ValueError(f"{MEMORY_ENV}={override!r} is not a number of GB; set e.g. {MEMORY_ENV}=24") from None
        if value <= 0:
            raise ValueError(f"{MEMORY_ENV} must be a positive number of GB, got {override}")
        return int(value * GB), MEMORY_ENV
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    working_set = info.get("max_recommended_working_set_size")
    if working_set:
        return int(working_set), "the GPU's recommended working set"
    total = info.get("memory_size")
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
    return int(total), "physical memory"


# ---------------------------------------------------------------------------------------------
# Weights as stored, without downloading them


def local_weight_bytes(directory: Path) -> int:
    """Bytes of a model directory's safetensors files (the index's total_size if only it is there)."""
    files = list(Path(directory).glob("*.safetensors"))
    if files:
        return sum(f.stat().st_size for f in files)
    index = Path(directory) / "model.safetensors.index.json"
    if index.exists():
        try:
            return int(json.loads(index.read_text()).get("metadata", {}).get("total_size", 0))
        except (OSError, ValueError):
            return 0
    return 0


def hub_weight_bytes(repo_id: str) -> Optional[int]:
    """Bytes of a Hub repo's safetensors files from its file listing (metadata only), or None
    when the Hub cannot be asked (offline, unknown repo: loading then says why)."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        info = HfApi().model_info(repo_id, files_metadata=True)
    except Exception:
        return None
    sizes = [s.size or 0 for s in (info.siblings or []) if s.rfilename.endswith(".safetensors")]
    return sum(sizes) if sizes else None


def hub_config(repo_id: str) -> Optional[dict]:
    """A Hub repo's config.json (a small file; cached by huggingface_hub), or None."""
    from huggingface_hub import hf_hub_download

    try:
        return json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text())
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# The pre-flight


class DoesNotFit(RuntimeError):
    """A pair that cannot fit in this machine's memory; the message is one line."""


def gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


def check_fits(needed: MemoryPlan, has: int, source: str, label: str) -> None:
    """Raise DoesNotFit (one line: needs, has, what to try) when ``needed`` exceeds ``has``."""
    if has <= 0 or needed.needed <= has:
        return
    caches = needed.kv_cache + needed.gdn_states + needed.verify_states + needed.drafter_context
    raise DoesNotFit(
        f"{label} needs about {gb(needed.needed)} ({gb(needed.target_weights)} target + "
        f"{gb(needed.drafter_weights)} drafter weights + {gb(caches)} caches at {needed.context} tokens, "
        f"+{round((HEADROOM - 1) * 100)}%) but this machine has {gb(has)} ({source}); try a smaller "
        f"quantization (e.g. a 4-bit target, an 8-bit drafter from `dflash2-mlx convert --draft`) or a "
        f"shorter --max-context, or set {MEMORY_ENV} if you know better"
    )


def preflight(
    target: str, drafter: Optional[str], context: Optional[int] = None, label: Optional[str] = None
) -> Optional[MemoryPlan]:
    """Check, before any download or load, that the pair (local directories, repo ids, or a
    preset's repos) fits this machine's memory at ``context`` tokens (default: 32K, or the model's
    context if shorter). Raises DoesNotFit with one line; returns the plan, or None when the
    sizes cannot be known without downloading (loading then proceeds)."""
    from dflash2_mlx.models import drafter_precision, presets

    preset = presets.by_target(target)
    drafter_quantized = False  # a preset's drafter is stored in bf16
    if preset is not None and (drafter is None or drafter == preset.drafter):
        target_shape, drafter_shape = preset.target_shape, preset.drafter_shape
        target_weights, drafter_weights = preset.target_bytes, preset.drafter_bytes
        label = label or f"preset {preset.name}"
    else:
        found = _sizes(target, "model")
        if found is None:
            return None
        target_config, target_weights = found
        target_shape = TargetShape.from_config(target_config)
        drafter_shape, drafter_weights = None, 0
        if drafter is not None:
            found = _sizes(drafter, "draft model")
            if found is None:
                return None
            drafter_shape, drafter_weights = DrafterShape.from_config(found[0]), found[1]
            drafter_quantized = "quantization" in found[0]
            # a draft vocabulary's head: a copy of those rows of the target's head (float32 at most)
            draft_vocab = int((found[0].get("dflash_config") or {}).get("draft_vocab_size") or 0)
            drafter_weights += draft_vocab * int(found[0].get("hidden_size") or 0) * 4
        label = label or "this model pair"
    if drafter_shape is not None:  # on M1/M2 (or when forced) a 16-bit drafter is upcast to float32
        drafter_weights, drafter_shape = drafter_precision.planned_drafter_memory(
            drafter_weights, drafter_shape, drafter_quantized
        )
    limit = target_shape.max_context or DEFAULT_CONTEXT
    ctx = min(context or DEFAULT_CONTEXT, limit)
    needed = plan(target_shape, target_weights, drafter_shape, drafter_weights, ctx, keeps_verify_states(target_shape))
    has, source = available_bytes()
    check_fits(needed, has, source, label)
    return needed


def keeps_verify_states(target: TargetShape) -> bool:
    """Whether verify passes keep per-step states here: forced by DFLASH2_MLX_ROLLBACK=keep, or
    (auto) where the recurrence runs as ops (no Metal GPU) and a layer's states fit the bound
    (the rule of ``target._keeps_step_states``)."""
    from dflash2_mlx.backend import device
    from dflash2_mlx.caches.target import rollback_setting
    from dflash2_mlx.models.target import MAX_KEPT_STATE_BYTES

    setting = rollback_setting()
    if setting != "auto":
        return setting == "keep"
    per_layer = target.kept_verify_bytes() // max(1, target.gdn_layers)
    return not device.metal_gpu() and not device.forced_gpu_paths() and per_layer <= MAX_KEPT_STATE_BYTES


def _sizes(spec: str, what: str) -> Optional[tuple[dict, int]]:
    """(config, weight bytes) of a local directory or a repo id, without downloading weights."""
    if what == "model":
        from dflash2_mlx.models import gguf

        try:
            gguf_file = gguf.find_gguf(spec)
            if gguf_file is not None:
                return gguf.memory_sizes(gguf_file)
        except ValueError:
            return None  # loading says what is wrong with it
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None  # loading names the damaged file
        return config, local_weight_bytes(path)
    if path.exists():
        return None
    config = hub_config(spec)
    weights = hub_weight_bytes(spec) if config is not None else None
    return None if weights is None else (config, weights)


# ---------------------------------------------------------------------------------------------
# The wired limit


_WIRED: dict = {"limit": None}


def set_wired_limit(model_bytes: int) -> Optional[int]:
    """Wire the GPU's recommended working set, as mlx-lm does around generation
    (``mlx_lm.utils.maybe_set_recommended_wired_limit``), for the life of the process (our
    commands and the server own the models until they exit). Warns, as mlx-lm does, when the
    models take more than 90% of it. Returns the limit set, or None (no Metal GPU)."""
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    if not mx.metal.is_available() or maybe_set_recommended_wired_limit() is None:
        return None
    limit = int(mx.device_info()["max_recommended_working_set_size"])
    if model_bytes > 0.9 * limit:
        import warnings

        warnings.warn(
            f"the models take {model_bytes // 2**20} MB, close to the GPU's recommended working set of "
            f"{limit // 2**20} MB: generation may be slow (a smaller quantization helps)"
        )
    _WIRED["limit"] = limit
    return limit


def tree_bytes(module) -> int:
    """Bytes of a module's arrays (mlx-lm's wired_limit sums the same)."""
    from mlx.utils import tree_reduce

    return tree_reduce(lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc, module, 0)


def wired_limit() -> Optional[int]:
    """The wired limit :func:`set_wired_limit` set in this process (None: not set)."""
    return _WIRED["limit"]
