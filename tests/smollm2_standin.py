"""A stand-in for the SmolLM2 drafter the package ships (``dflash2_mlx/assets/smollm2-drafter``):
untrained, made by the project's own trainer init code (``training/drafter/initialise.py``) with the
build plan's drafter settings (``training/smollm2/plan.py`` FULL: 2 layers, block 8, taps 7 and 22,
mask id 16, selector rank 16), in the shipped layout (config.json, model.safetensors,
MANIFEST.json, README.md). Written to a temporary directory, never into the package.

The target it is made for is SmolLM2 as its GGUF metadata describes it (the config.json the
conversion writes, ``gguf.hf_config``): no conversion, no weights loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash2_mlx.models import gguf, named
from dflash2_mlx.training.drafter.config import DrafterTrainingConfig
from dflash2_mlx.training.drafter.initialise import init_drafter, make_drafter_config
from dflash2_mlx.training.smollm2.plan import FULL


def training_config(plan=FULL) -> DrafterTrainingConfig:
    """The drafter settings of the SmolLM2 build (as ``smollm2.stages.train`` makes them)."""
    return DrafterTrainingConfig(
        block_size=plan.drafter_block_size,
        layers=plan.drafter_layers,
        steps=plan.drafter_steps,
        seed=plan.seed,
        target_layer_ids=list(plan.drafter_taps),
        **plan.drafter_options,
    )


def smollm2_from_metadata() -> SimpleNamespace:
    """What ``make_drafter_config`` reads of a loaded SmolLM2 (``loading.Target``), from the
    wheel's GGUF metadata alone."""
    config, _ = gguf.memory_sizes(named.model_file("smollm2"))
    runner = SimpleNamespace(
        hidden_size=config["hidden_size"], vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"]
    )
    return SimpleNamespace(runner=runner, config=config, name="smollm2", tokenizer=None)


def write_standin_drafter(out: Path, target=None) -> Path:
    """The untrained stand-in drafter for ``target`` (default: SmolLM2 from its metadata) in ``out``."""
    target = target or smollm2_from_metadata()
    cfg = training_config()
    drafter = init_drafter(make_drafter_config(target, cfg), cfg)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(sorted(tree_flatten(drafter.parameters()))))
    (out / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2))
    (out / "MANIFEST.json").write_text(json.dumps({"name": "smollm2-drafter stand-in", "trained": False}))
    (out / "README.md").write_text("An untrained stand-in for the SmolLM2 drafter, made by the tests.\n")
    return out
