"""The stages of the SmolLM2 drafter build after the prompts: continuations, training, evaluation.

Continuations ("greedy", "sampled"): the target's own answers to the training prompts, a batch of
prompts per forward, one chunk file per batch (a kill loses at most the batch in progress). Each
training sequence is the last ``context_len`` tokens of the (left-padded) prompt followed by
``continuation_len`` generated tokens, so all sequences have one length, as the trainer needs.

The continuation stages record token ids only, not the target's tapped features: the trainer
(``target_features.TargetFeatures``) computes features from token sequences (a batched prefill,
at about 2-4x the target's batched decoding rate here), and the sequences the trainer reads are
windows of the generated text, whose features the generation pass (full prompt as context) does
not give. The "features" stage computes them once per window, chunked, and keeps them on disk
(about 2.7 GB for the full plan) so that a killed training stage resumes without that pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dflash2_mlx.decoding.sampling import SamplingSettings
from dflash2_mlx.training.smollm2_generation import generate_batch, left_pad, pad_token_id
from dflash2_mlx.training.smollm2_plan import SmolPlan, atomic_write_bytes, stage_key
from dflash2_mlx.training.smollm2_prompts import read_prompt_set

__all__ = [
    "compute_features",
    "continuation_batches",
    "copy_drafter",
    "drafter_bytes",
    "generate_continuations",
    "load_features",
    "load_sequences",
    "save_untrained_drafter",
    "train",
    "training_config",
]


def _chunk_done(path: Path, key: str) -> bool:
    """A chunk file written by an earlier run from the same inputs (its stored key matches)."""
    if not path.exists():
        return False
    with np.load(path) as old:
        return str(old["key"]) == key


def continuation_batches(plan: SmolPlan, tokenizer, prompts: list[dict]) -> list[list[list[int]]]:
    """The training prompts' token ids, sorted by length (ties in file order) and cut into batches."""
    ids = [tokenizer.encode(p["prompt"], add_special_tokens=False) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    ordered = [ids[i] for i in order]
    return [ordered[i : i + plan.batch_size] for i in range(0, len(ordered), plan.batch_size)]


def generate_continuations(
    plan: SmolPlan,
    target,
    prompts_file: Path,
    out_dir: Path,
    sampled: bool,
    log: Callable[[str], None],
    committed: Optional[Path] = None,
) -> dict:
    """Write one ``chunk_NNNNN.npz`` per batch into ``out_dir`` (existing chunks of the same inputs
    are kept; so are ``committed``'s, copied: a fresh machine then generates none of them) and
    return the stage's counts and rate."""
    prompts = read_prompt_set(prompts_file, "train")
    tok = target.tokenizer
    batches = continuation_batches(plan, tok, prompts)
    sampling = SamplingSettings(plan.sample_temperature, plan.sample_top_p) if sampled else None
    pad = pad_token_id(tok)
    seed = plan.seed + (2 if sampled else 1)
    total_len = plan.context_len + plan.continuation_len
    generated_tokens, seconds, reused, copied = 0, 0.0, 0, 0
    for index, batch in enumerate(batches):
        # a chunk is valid for exactly its own input tokens and settings
        key = stage_key(
            tokens=[list(map(int, p)) for p in batch],
            length=plan.continuation_len,
            context=plan.context_len,
            sampling=dataclasses.asdict(sampling) if sampling else None,
            seed=seed + index,
            target=plan.target,
        )
        path = out_dir / f"chunk_{index:05d}.npz"
        if _chunk_done(path, key):
            reused += 1
            continue
        if committed is not None and _chunk_done(committed / path.name, key):
            atomic_write_bytes(path, (committed / path.name).read_bytes())
            copied += 1
            continue
        t0 = time.perf_counter()
        padded = left_pad(batch, pad, min_len=plan.context_len)
        answers = generate_batch(target.runner, padded, plan.continuation_len, sampling, seed=seed + index)
        sequences = np.concatenate([padded[:, -plan.context_len :], answers], axis=1)
        assert sequences.shape[1] == total_len
        buffer = io.BytesIO()
        np.savez(buffer, sequences=sequences, prompt_tokens=np.array([len(p) for p in batch]), key=np.array(key))
        atomic_write_bytes(path, buffer.getvalue())
        dt = time.perf_counter() - t0
        seconds += dt
        generated_tokens += answers.size
        log(
            f"{'sampled' if sampled else 'greedy'}: chunk {index + 1}/{len(batches)} "
            f"({len(batch)} x {padded.shape[1]} prompt + {plan.continuation_len} tokens) in {dt:.1f}s, "
            f"{answers.size / dt:.1f} generated tokens/s"
        )
    sequences = load_sequences(out_dir, len(batches))
    return {
        "chunks": len(batches),
        "chunks_reused": reused,
        "chunks_copied_from_committed": copied,
        "sequences": int(sequences.shape[0]),
        "sequence_length": total_len,
        "generated_tokens_this_run": generated_tokens,
        "generated_tokens_per_second": round(generated_tokens / seconds, 2) if seconds else None,
        "sha256": hashlib.sha256(sequences.tobytes()).hexdigest(),
    }


def load_sequences(out_dir: Path, chunks: int) -> np.ndarray:
    """int32 [n, context_len + continuation_len]: the chunks' sequences in chunk order."""
    parts = []
    for index in range(chunks):
        with np.load(Path(out_dir) / f"chunk_{index:05d}.npz") as data:
            parts.append(np.asarray(data["sequences"], dtype=np.int32))
    return np.concatenate(parts)


def compute_features(plan: SmolPlan, target, sequences: np.ndarray, out_dir: Path, log: Callable[[str], None]) -> dict:
    """The target's tapped features (and final-normed hidden state, for soft targets) of every
    training sequence, one ``features_NNNNN.npz`` per batch in ``out_dir``; chunks of the same
    tokens and taps are kept. The trainer would compute them itself before its first step, but on
    disk a resumed training run does not pay this pass again."""
    from dflash2_mlx.training.target_features import TargetFeatures

    taps = list(plan.drafter_taps)
    chunks = range(0, len(sequences), plan.batch_size)
    reused, seconds = 0, 0.0
    for index, start in enumerate(chunks):
        tokens = sequences[start : start + plan.batch_size]
        key = stage_key(tokens=hashlib.sha256(tokens.tobytes()).hexdigest(), taps=taps, target=plan.target)
        path = out_dir / f"features_{index:05d}.npz"
        if _chunk_done(path, key):
            reused += 1
            continue
        t0 = time.perf_counter()
        feats, final = TargetFeatures(target.runner, tokens, taps, budget=1 << 62, final=True).cached
        buffer = io.BytesIO()
        np.savez(buffer, features=np.array(feats), final=np.array(final), key=np.array(key))
        atomic_write_bytes(path, buffer.getvalue())
        dt = time.perf_counter() - t0
        seconds += dt
        log(f"features: chunk {index + 1}/{len(chunks)} in {dt:.1f}s, {tokens.size / dt:.0f} tokens/s")
    return {"chunks": len(chunks), "chunks_reused": reused, "seconds_this_run": round(seconds, 1)}


def load_features(plan: SmolPlan, target, sequences: np.ndarray, out_dir: Path, chunks: int):
    """``TargetFeatures`` of ``sequences`` read back from ``compute_features``'s chunk files."""
    import mlx.core as mx

    from dflash2_mlx.training.target_features import TargetFeatures

    feats, finals = [], []
    for index in range(chunks):
        with np.load(Path(out_dir) / f"features_{index:05d}.npz") as data:
            feats.append(mx.array(data["features"]))
            finals.append(mx.array(data["final"]))
    features, final = mx.concatenate(feats), mx.concatenate(finals)
    del feats, finals
    mx.eval(features, final)
    return TargetFeatures.from_arrays(target.runner, sequences, list(plan.drafter_taps), features, final)


def drafter_bytes(drafter_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(drafter_dir).glob("*.safetensors"))


def training_config(plan: SmolPlan, target, stop_at_step: Optional[int] = None):
    """The trainer's DrafterTrainingConfig for the plan's drafter (taps checked against ``target``)."""
    from dflash2_mlx.training.drafter_training_config import DrafterTrainingConfig

    taps = list(plan.drafter_taps)
    last = len(target.runner.layers) - 1
    if last in taps or max(taps) > last:
        raise ValueError(f"drafter taps {taps} must be layers of the target below its last one ({last})")
    return DrafterTrainingConfig(
        block_size=plan.drafter_block_size,
        layers=plan.drafter_layers,
        steps=plan.drafter_steps,
        seed=plan.seed,
        convs=True,
        selector=True,
        target_layer_ids=taps,
        stop_at_step=stop_at_step,
        **plan.drafter_options,
    )


def save_untrained_drafter(plan: SmolPlan, target, out: Path) -> Path:
    """The plan's drafter as the trainer starts it (its initialisation, no training step) in ``out``
    (config.json + model.safetensors): a stand-in with the trained drafter's shapes, taps, block
    size and mask token, for developing what will run on the trained one. Its drafts are rarely
    accepted, so it exercises the rejection paths, not the speed."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash2_mlx.training.drafter_init import init_drafter, make_drafter_config

    cfg = training_config(plan, target)
    drafter = init_drafter(make_drafter_config(target, cfg), cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    buffer = out / "model.partial.safetensors"
    mx.save_safetensors(str(buffer), dict(sorted(tree_flatten(drafter.parameters()))))
    buffer.replace(out / "model.safetensors")
    atomic_write_bytes(out / "config.json", (json.dumps(drafter.config.to_dict(), indent=2) + "\n").encode())
    return out


def train(
    plan: SmolPlan,
    target,
    sequences: np.ndarray,
    out_dir: Path,
    log: Callable[[str], None],
    progress: bool = False,
    features=None,
    stop_at_step: Optional[int] = None,
    draft_vocab: Optional[np.ndarray] = None,
) -> dict:
    """Train (or resume training) the drafter in ``out_dir`` on ``sequences`` with soft targets
    (``features``: the target's taps of ``sequences`` computed before, see ``load_features``;
    ``draft_vocab``: the token ids the drafter scores, trained on as it will draft)."""
    from dflash2_mlx.training.drafter_trainer import train_drafter

    cfg = training_config(plan, target, stop_at_step)
    t0 = time.perf_counter()
    train_drafter(
        target,
        sequences,
        out_dir,
        cfg,
        continuation_start=plan.context_len,
        progress=progress,
        features=features,
        draft_vocab=draft_vocab,
        max_bytes=plan.max_drafter_bytes,
    )
    seconds = time.perf_counter() - t0
    size = drafter_bytes(out_dir)
    state = json.loads((Path(out_dir) / "training_state" / "state.json").read_text())
    log(
        f"train: at step {state.get('step')} of {plan.drafter_steps} after {seconds:.0f}s this run; "
        f"drafter {size / 1e6:.1f} MB"
    )
    if size > plan.max_drafter_bytes:
        raise ValueError(f"the drafter is {size / 1e6:.1f} MB, over the {plan.max_drafter_bytes / 1e6:.0f} MB budget")
    return {
        "training": dataclasses.asdict(cfg),
        "bytes": size,
        "seconds_this_run": round(seconds, 1),
        "loss_history": state.get("history", [])[-5:],
        "steps": state.get("step"),
    }


def copy_drafter(drafter_dir: Path, out: Path) -> None:
    """The shippable drafter (weights and config, no training state) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(Path(drafter_dir) / name, out / name)
