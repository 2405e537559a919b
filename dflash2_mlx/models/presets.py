"""Named model presets: a target repo, the DFlash 2 drafter made for it, and what they need.

``dflash2-mlx chat --preset qwen3.8-27b`` resolves to the repos below (downloaded on first use).
Repo ids marked ``verified=False`` follow the usual naming on the Hub but have not been checked
to exist with these exact names: the docs say so, and an unknown repo fails with a one-line
"not found" error that names it, so pass ``--model`` / ``--draft-model`` explicitly instead.

Memory figures are for planning against the GPU wired limit on a Mac (unified memory): weights
as stored, plus the caches of one conversation. They are estimates from the shapes in
``shared/reference`` (64-layer target, 5-layer drafter), not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dflash2_mlx.models.shapes import GB, DrafterShape, TargetShape

# The shapes of /work/shared/reference (qwen3.8-27b and qwen3.8-27b-dflash2 config.json): what
# sizes the caches, known without downloading anything (the memory pre-flight uses them).
QWEN38_27B_SHAPE = TargetShape(
    attention_layers=16,
    kv_heads=4,
    head_dim=256,  # every 4th of 64 layers is gated attention
    gdn_layers=48,
    gdn_value_heads=48,
    gdn_value_dim=128,
    gdn_key_heads=16,
    gdn_key_dim=128,
    conv_kernel=4,
    kv_bytes=2,
    max_context=262144,
)
DFLASH2_27B_SHAPE = DrafterShape(layers=5, kv_heads=8, head_dim=128, window=2048, kv_bytes=2)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: str  # repo id of the MLX target
    drafter: str  # repo id of the DFlash 2 drafter
    target_gb: float  # weights of the target as stored
    drafter_gb: float  # weights of the drafter as stored (bf16; an 8-bit `convert --draft` copy is ~2 GB)
    cache_gb_per_32k: float  # target KV + Gated DeltaNet state + drafter context, per 32K tokens
    verified: bool = False  # repo ids checked to exist on the Hub
    block_size: int = 8
    target_shape: TargetShape = QWEN38_27B_SHAPE
    drafter_shape: DrafterShape = DFLASH2_27B_SHAPE

    @property
    def target_bytes(self) -> int:
        return int(self.target_gb * GB)

    @property
    def drafter_bytes(self) -> int:
        return int(self.drafter_gb * GB)

    def total_gb(self, context_tokens: int = 32768) -> float:
        return self.target_gb + self.drafter_gb + self.cache_gb_per_32k * context_tokens / 32768

    def memory_line(self) -> str:
        return (
            f"about {self.target_gb:.0f} GB target + {self.drafter_gb:.1f} GB drafter + "
            f"{self.cache_gb_per_32k:.1f} GB caches per 32K tokens of context "
            f"(~{self.total_gb():.0f} GB at 32K)"
        )


# Cache estimate for Qwen3.8-27B: 16 gated-attention layers x 4 KV heads x 256 dims x (K+V) x 2 bytes
# = 64 KiB/token (2 GiB per 32K); 48 Gated DeltaNet layers hold a fixed ~0.2 GB state; the drafter's
# context cache is bounded by its 2048-token sliding window (5 layers x 8 x 128 x 2 x 2 B x 2047 ~ 40 MB).
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="qwen3.8-27b",
            description="Qwen3.8-27B (MLX 4-bit) + DFlash 2 drafter (bf16), block size 8",
            target="mlx-community/Qwen3.8-27B-4bit",
            drafter="z-lab/Qwen3.8-27B-DFlash2",
            target_gb=15.0,
            drafter_gb=3.7,
            cache_gb_per_32k=2.3,
        ),
        Preset(
            name="qwen3.8-27b-8bit",
            description="Qwen3.8-27B (MLX 8-bit) + DFlash 2 drafter, for Macs with 48 GB or more",
            target="mlx-community/Qwen3.8-27B-8bit",
            drafter="z-lab/Qwen3.8-27B-DFlash2",
            target_gb=29.0,
            drafter_gb=3.7,
            cache_gb_per_32k=2.3,
        ),
    )
}


class UnknownPreset(KeyError):
    pass


def by_target(repo_id: str) -> Optional[Preset]:
    """The preset whose target is ``repo_id`` (its recorded sizes stand in for a download)."""
    return next((p for p in PRESETS.values() if p.target == repo_id), None)


def get_preset(name: str) -> Preset:
    key = name.strip().lower()
    if key not in PRESETS:
        raise UnknownPreset(f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]
