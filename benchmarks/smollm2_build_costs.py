"""What the SmolLM2 drafter build's stages cost, measured in one process so the ratios hold.

    python benchmarks/smollm2_build_costs.py            # SmolLM2: fetched on first use (named.py)

Prints one JSON object: seconds for 9 generation steps at batch 32 (a prefill of 32 x 64 tokens
included), for the tapped features of 32 windows of 192 tokens, and per training step of the full
plan (8 steps on random tokens, the first two left out: compilation), then the first two again.
On a shared machine read the ratios, not the seconds (docs/smollm2.md).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

from dflash2_mlx.training.build_common import fix_threads

fix_threads()

import numpy as np  # noqa: E402

from dflash2_mlx.models.loading import load_target  # noqa: E402
from dflash2_mlx.training.drafter.features import TargetFeatures  # noqa: E402
from dflash2_mlx.training.smollm2.generation import answer_prompts  # noqa: E402
from dflash2_mlx.training.smollm2.plan import FULL  # noqa: E402
from dflash2_mlx.training.smollm2.stages import make_windows, train  # noqa: E402


def main() -> None:
    target = load_target("smollm2")
    windows = np.random.default_rng(0).integers(17, 49152, size=(32, FULL.context_len + FULL.continuation_len))
    windows = windows.astype(np.int32)

    def generation_seconds() -> float:
        t = time.perf_counter()
        answer_prompts(target.runner, windows[:, : FULL.context_len].tolist(), 9)
        return time.perf_counter() - t

    def feature_seconds() -> float:
        t = time.perf_counter()
        TargetFeatures(target.runner, windows, list(FULL.drafter_taps), 1 << 40, final=True)
        return time.perf_counter() - t

    generation, features = [generation_seconds()], [feature_seconds()]
    plan = dataclasses.replace(
        FULL, drafter_steps=8, drafter_options={**FULL.drafter_options, "log_every": 1, "checkpoint_every": 0}
    )
    with tempfile.TemporaryDirectory() as tmp:
        prompts = windows[:, : FULL.context_len].tolist()
        answers = [row[FULL.context_len :] for row in windows]
        data = make_windows(prompts, answers, FULL.context_len, FULL.continuation_len)
        info = train(plan, target, data, Path(tmp) / "drafter", print)
        history = json.loads((Path(tmp) / "drafter" / "training_state" / "state.json").read_text())["history"]
    generation.append(generation_seconds())
    features.append(feature_seconds())
    print(
        json.dumps(
            {
                "generation_9_steps_batch_32_s": generation,
                "features_32_windows_s": features,
                "train_step_s": [1 / h["steps_s"] for h in history[2:]],
                "drafter_bytes": info["bytes"],
            }
        )
    )


if __name__ == "__main__":
    main()
