"""The drafter trainer's learning-rate schedule and its progress line.

Linear warmup then cosine decay over the step budget (or the clock, for a minutes budget); the text of the
progress line (backend.progress draws the bar): the windowed loss, accuracies, tau and throughput.
"""

from __future__ import annotations

import math

from dflash2_mlx.training.drafter.config import DrafterTrainingConfig

__all__ = [
    "format_progress",
    "learning_rate_at",
]


def learning_rate_at(config: DrafterTrainingConfig, fraction: float) -> float:
    """Linear warmup over ``warmup_fraction`` of the budget, then cosine to ``min_learning_rate_ratio``."""
    peak, floor = config.learning_rate, config.learning_rate * config.min_learning_rate_ratio
    fraction = min(max(fraction, 0.0), 1.0)
    warm = config.warmup_fraction
    if warm > 0 and fraction < warm:
        return peak * (fraction / warm)
    span = max(1.0 - warm, 1e-9)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * (fraction - warm) / span))


def format_progress(m: dict) -> str:
    """loss, drafter top-1 accuracy, selector accuracy, anchor-mean tau (reads higher than the
    real tokens per cycle: see ``evaluate_drafter``), sequence tokens per second."""
    parts = [f"loss {m['loss']:.3f}", f"acc {m['acc']:.2f}"]
    if "sel_acc" in m:
        parts.append(f"sel {m['sel_acc']:.2f}")
    parts += [f"τ~{m['tau']:.2f}", f"{m['tok_s']:.0f} tok/s"]
    return " ".join(parts)
