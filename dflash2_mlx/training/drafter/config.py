"""The drafter trainer's settings: architecture, budget, optimisation and machinery knobs.

``DrafterTrainingConfig`` is what ``train_drafter``, ``dflash2-mlx train-drafter``, the demo
build and the ablation fill in; it validates itself, resolves the loss decay ``gamma`` for a
block size and says which of its fields a resumed run may change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dflash2_mlx.models.drafter_config import DFLASH1, DFLASH2

__all__ = [
    "DEFAULT_STEPS",
    "DrafterTrainingConfig",
    "RESUMABLE_CHANGES",
]


DEFAULT_STEPS = 1000


@dataclass
class DrafterTrainingConfig:
    """Every knob of a drafter training run (defaults: the recipe in ``trainer``)."""

    # architecture
    block_size: int = 8
    layers: int = 2
    convs: bool = True
    selector: bool = True
    target_layer_ids: Optional[list[int]] = None  # None: evenly spread non-final layers
    num_taps: Optional[int] = None  # None: one per drafter layer (the reference's rule)
    intermediate_size: Optional[int] = None  # None: the target's
    num_attention_heads: Optional[int] = None  # None: the target's
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    sliding_window: Optional[int] = 2048  # the real drafter's layout; None: full attention
    conv_group_size: int = 16
    conv_kernel_size: int = 2
    selector_top_k: int = 16
    selector_rank: int = 32
    mask_token_id: Optional[int] = None  # None: the tokenizer's "<|mask|>"
    # budget
    steps: Optional[int] = None  # None with minutes None: DEFAULT_STEPS
    minutes: Optional[float] = None  # wall-clock budget (not deterministic)
    stop_at_step: Optional[int] = None  # end this run early, as an interruption would (resume later)
    seed: int = 0
    # optimisation
    learning_rate: float = 3e-3
    min_learning_rate_ratio: float = 0.1
    warmup_fraction: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int = 8  # sequences per step
    blocks_per_sequence: int = 16  # anchors per sequence per step
    gamma: Optional[float] = None  # loss decay along the block; None: 7 / 5 / 4 for B = 16 / 10 / 8
    selector_loss_weight: float = 1.0
    # share of each row's loss from the target's whole next-token distribution (cross-entropy to
    # its softmax: KL up to the target's entropy), the rest from the label; 0: labels only
    soft_target_weight: float = 0.0
    selector_grad_to_drafter: bool = False
    # anchors only before the first of these tokens in the generated part (the end of the turn):
    # a target's text after it ends its turn is never drafted, yet generated continuations of a
    # fixed length keep it (SmolLM2's: about 30% of the tokens). Empty: anchors anywhere
    answer_end_token_ids: list[int] = field(default_factory=list)
    selector_init_std: float = 0.1
    # machinery
    compile: bool = True
    feature_cache_bytes: int = 2 << 30  # precompute the target's features when they fit
    checkpoint_every: int = 200
    log_every: int = 10

    def resolved_gamma(self) -> float:
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2))

    @property
    def architecture(self) -> str:
        return DFLASH2 if (self.convs or self.selector) else DFLASH1

    def validate(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block size must be at least 2, got {self.block_size}")
        if self.layers < 1:
            raise ValueError(f"layers must be at least 1, got {self.layers}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if self.batch_size < 1 or self.blocks_per_sequence < 1:
            raise ValueError("batch_size and blocks_per_sequence must be at least 1")
        if not self.learning_rate > 0:
            raise ValueError(f"learning rate must be positive, got {self.learning_rate}")
        if not 0.0 <= self.soft_target_weight <= 1.0:
            raise ValueError(f"soft_target_weight must be in [0, 1], got {self.soft_target_weight}")
        if self.selector and self.selector_top_k < 2:
            raise ValueError(f"selector_top_k must be at least 2, got {self.selector_top_k}")

    @property
    def total_steps(self) -> Optional[int]:
        """The step budget the schedule plans for (None: a minutes-only run)."""
        if self.steps is not None:
            return self.steps
        return None if self.minutes is not None else DEFAULT_STEPS


# Fields that may change between a run and its resumption (budget and bookkeeping only).
RESUMABLE_CHANGES = {
    "steps",
    "minutes",
    "stop_at_step",
    "compile",
    "feature_cache_bytes",
    "checkpoint_every",
    "log_every",
}
