"""Checkpoints of a drafter training run, and resuming from them.

``out_dir`` holds the weights and config.json in the real layout; ``out_dir/training_state/``
holds the optimiser state and the run's bookkeeping (step, history, config, data fingerprint).
Every file is written under a temporary name and renamed, the state last with the others'
hashes, so a checkpoint interrupted half-way is detected on resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dflash2_mlx.backend.files import sha256_file
from dflash2_mlx.models.drafter import DRAFT_VOCAB_KEY, Drafter
from dflash2_mlx.training.drafter.config import DrafterTrainingConfig

__all__ = [
    "STATE_DIR",
    "config_record",
    "data_fingerprint",
    "load_checkpoint_state",
    "resume_checkpoint",
    "save_checkpoint",
]


STATE_DIR = "training_state"


def data_fingerprint(sequences: np.ndarray, continuation_start, lengths: Optional[np.ndarray] = None) -> str:
    """sha256 of the training data: the rows, where their answers start (an int or one per
    row) and, when given, their real lengths."""
    h = hashlib.sha256(np.ascontiguousarray(sequences, dtype=np.int32).tobytes())
    if np.ndim(continuation_start) == 0 and lengths is None:
        h.update(f"{sequences.shape}:{continuation_start}".encode())  # the fingerprint of runs made before
    else:
        h.update(f"{sequences.shape}:".encode())
        h.update(
            np.ascontiguousarray(np.broadcast_to(continuation_start, sequences.shape[:1]), dtype=np.int64).tobytes()
        )
        if lengths is not None:
            h.update(b"lengths:" + np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return h.hexdigest()


def config_record(config: DrafterTrainingConfig) -> dict:
    return dataclasses.asdict(config)


def checkpoint_tensors(drafter: Drafter) -> dict[str, mx.array]:
    """What a drafter checkpoint's model.safetensors holds: the parameters, and the draft
    vocabulary when it has one (the layout load_drafter reads; config.json has its size)."""
    tensors = dict(tree_flatten(drafter.parameters()))
    if drafter.draft_vocab is not None:
        tensors[DRAFT_VOCAB_KEY] = drafter.draft_vocab
    return tensors


def save_checkpoint(out_dir: Path, drafter: Drafter, optimizer: optim.Optimizer, state: dict) -> None:
    """Weights + config in the real layout, optimiser state + bookkeeping in training_state/.

    Every file is written under a temporary name and renamed; the state JSON goes last and records
    the other files' hashes, so a checkpoint interrupted half-way is detected on resume.
    """
    sd = out_dir / STATE_DIR
    sd.mkdir(parents=True, exist_ok=True)
    tmp_model = sd / "model.partial.safetensors"
    tmp_opt = sd / "optimizer.partial.safetensors"
    # sorted names: the same state gives the same bytes, however the trees were built
    mx.save_safetensors(str(tmp_model), dict(sorted(checkpoint_tensors(drafter).items())))
    moments = ((k, v) for k, v in tree_flatten(optimizer.state) if k not in ("step", "learning_rate"))
    mx.save_safetensors(str(tmp_opt), dict(sorted(moments)))
    tmp_cfg = sd / "config.partial.json"
    tmp_cfg.write_text(json.dumps(drafter.config.to_dict(), indent=2))
    state = dict(state, model_sha256=sha256_file(tmp_model), optimizer_sha256=sha256_file(tmp_opt))
    tmp_state = sd / "state.partial.json"
    tmp_state.write_text(json.dumps(state, indent=2))
    os.replace(tmp_model, out_dir / "model.safetensors")
    os.replace(tmp_cfg, out_dir / "config.json")
    os.replace(tmp_opt, sd / "optimizer.safetensors")
    os.replace(tmp_state, sd / "state.json")


def load_checkpoint_state(out_dir: Path) -> Optional[dict]:
    """The bookkeeping of a run saved in ``out_dir`` (None when there is none)."""
    path = Path(out_dir) / STATE_DIR / "state.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"cannot read {path} ({e}); the training state is damaged: delete {path.parent} to start afresh"
        ) from None


def resume_checkpoint(out_dir: Path, state: dict, drafter: Drafter, optimizer: optim.Optimizer) -> None:
    sd = out_dir / STATE_DIR
    model_path, opt_path = out_dir / "model.safetensors", sd / "optimizer.safetensors"
    if (
        not model_path.exists()
        or not opt_path.exists()
        or sha256_file(model_path) != state.get("model_sha256")
        or sha256_file(opt_path) != state.get("optimizer_sha256")
    ):
        raise ValueError(
            f"the checkpoint in {out_dir} is incomplete (interrupted while saving); "
            f"delete {out_dir} (or use another output directory) to start afresh"
        )
    weights = mx.load(str(model_path))
    saved_vocab, vocab = weights.pop(DRAFT_VOCAB_KEY, None), drafter.draft_vocab
    if (saved_vocab is None) != (vocab is None) or (vocab is not None and not mx.array_equal(saved_vocab, vocab)):
        raise ValueError(f"{out_dir} holds a run with another draft vocabulary; pick another output directory")
    drafter.load_weights(list(weights.items()))
    flat = mx.load(str(opt_path))
    opt_state = tree_unflatten(list(flat.items()))
    opt_state["step"] = mx.array(int(state["step"]), dtype=mx.uint64)
    opt_state["learning_rate"] = mx.array(0.0, dtype=mx.float32)
    optimizer.state = opt_state
    optimizer.init(drafter.trainable_parameters())  # keeps the loaded moments (only fills gaps)
    mx.eval(drafter.parameters(), optimizer.state)
