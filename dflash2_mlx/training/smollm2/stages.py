"""The stages of the SmolLM2 drafter build after the prompts: continuations, training, evaluation.

Continuations ("greedy", "sampled"): the target's own answers to the training prompts, each as
the engine writes it alone (``generation.answer_prompts``: no padding seen, stopped at its
end token), a batch of prompts per forward, one chunk file per batch (a kill loses at most the
batch in progress). Each training sequence (a window) is the prompt's last ``context_len``
tokens (all of it when shorter) followed by the answer, filled after its end to one length,
as the trainer needs; ``Windows`` keeps where each answer starts and how much of its row is real.

The continuation stages record token ids only, not the target's tapped features: the trainer
reads the features of its windows, and those come from the whole prompt and the answer (a
window may hold only the prompt's tail). The "features" stage computes them once per chunk (one
forward over each prompt + answer, filled after its end: causal, so the fill changes nothing
before it) and keeps them on disk so that a killed training stage resumes without that pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dflash2_mlx.decoding.sampling import SamplingSettings
from dflash2_mlx.training.smollm2.generation import GENERATION_RECIPE, answer_prompts
from dflash2_mlx.training.smollm2.plan import SmolPlan, atomic_write_bytes, stage_key
from dflash2_mlx.training.smollm2.prompts import read_prompt_set

__all__ = [
    "FEATURES_RECIPE",
    "Windows",
    "compute_features",
    "continuation_batches",
    "copy_drafter",
    "drafter_bytes",
    "generate_continuations",
    "load_features",
    "load_sequences",
    "load_windows",
    "make_windows",
    "save_untrained_drafter",
    "train",
    "training_config",
    "window_features",
]

# Part of every feature chunk's key: the features of each window come from its whole prompt
FEATURES_RECIPE = "whole prompt + answer, windows cut after"
FILL = 0  # the token after an answer's end in its row (never read: the row's length says so)


@dataclass
class Windows:
    """Training windows: ``sequences`` [n, S] (the prompt's tail, the answer, then fill),
    ``starts`` [n] (the answer's first position in the row), ``lengths`` [n] (the row's real
    tokens: the tail and the answer with its end token) and ``prompts`` (each whole prompt)."""

    sequences: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    prompts: list

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: slice) -> "Windows":
        return Windows(self.sequences[index], self.starts[index], self.lengths[index], self.prompts[index])

    @staticmethod
    def concatenate(parts: list["Windows"]) -> "Windows":
        return Windows(
            np.concatenate([w.sequences for w in parts]),
            np.concatenate([w.starts for w in parts]),
            np.concatenate([w.lengths for w in parts]),
            [p for w in parts for p in w.prompts],
        )

    def arrays(self) -> dict:
        """The arrays a chunk file stores (``np.savez(file, **windows.arrays())``)."""
        return {
            "sequences": self.sequences,
            "starts": self.starts,
            "lengths": self.lengths,
            "prompt_tokens": np.array([len(p) for p in self.prompts]),
            "prompts": np.concatenate([np.asarray(p, dtype=np.int32) for p in self.prompts]),
        }

    @staticmethod
    def from_arrays(data) -> "Windows":
        """The windows of a file ``arrays`` wrote (an open ``np.load``)."""
        sizes = np.asarray(data["prompt_tokens"])
        return Windows(
            np.asarray(data["sequences"], dtype=np.int32),
            np.asarray(data["starts"], dtype=np.int64),
            np.asarray(data["lengths"], dtype=np.int64),
            np.split(np.asarray(data["prompts"], dtype=np.int32), np.cumsum(sizes)[:-1]),
        )

    def answer(self, i: int) -> np.ndarray:
        return self.sequences[i, self.starts[i] : self.lengths[i]]

    def offset(self, i: int) -> int:
        """Where row i begins in its whole prompt + answer (the prompt tokens it leaves out)."""
        return len(self.prompts[i]) - int(self.starts[i])

    def whole(self, i: int) -> np.ndarray:
        """Row i's whole prompt, then its answer."""
        return np.concatenate([np.asarray(self.prompts[i], dtype=np.int32), self.answer(i)])

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.sequences, self.starts, self.lengths):
            h.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
        for p in self.prompts:
            h.update(np.asarray(p, dtype=np.int64).tobytes() + b"|")
        return h.hexdigest()


def make_windows(prompts: list, answers: list, context_len: int, answer_len: int) -> Windows:
    """The windows of ``prompts`` and their ``answers``: each prompt's last ``context_len``
    tokens (no padding: a shorter prompt is whole and its answer starts earlier), the answer, then
    fill to ``context_len + answer_len``."""
    width = context_len + answer_len
    sequences = np.full((len(prompts), width), FILL, dtype=np.int32)
    starts, lengths = np.zeros(len(prompts), np.int64), np.zeros(len(prompts), np.int64)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        tail = np.asarray(prompt[-context_len:], dtype=np.int32)
        if len(answer) > answer_len:
            raise ValueError(f"an answer of {len(answer)} tokens does not fit windows of {answer_len}")
        starts[row], lengths[row] = len(tail), len(tail) + len(answer)
        sequences[row, : lengths[row]] = np.concatenate([tail, np.asarray(answer, dtype=np.int32)])
    return Windows(sequences, starts, lengths, [np.asarray(p, dtype=np.int32) for p in prompts])


def _chunk_done(path: Path, key: str) -> bool:
    """A chunk file written by an earlier run from the same inputs (its stored key matches, and it
    is of this recipe's layout: the left-padded chunks made before issue 40 have no lengths)."""
    if not path.exists():
        return False
    with np.load(path) as old:
        return str(old["key"]) == key and "lengths" in old.files


# Kinds batch in these groups, one after the other. A kind added to the prompt set later gets a
# group of its own, so the earlier kinds' batches, whose chunks are committed and keyed by their
# tokens, stay exactly as they were.
BATCH_GROUPS = (("code", "explain", "short", "self"), ("task",))


def continuation_batches(plan: SmolPlan, tokenizer, prompts: list[dict]) -> list[list[list[int]]]:
    """The training prompts' token ids cut into batches: by group of kinds (``BATCH_GROUPS``), each
    sorted by length (ties in file order)."""
    unknown = {p["kind"] for p in prompts} - {kind for group in BATCH_GROUPS for kind in group}
    if unknown:
        raise ValueError(f"prompt kinds {sorted(unknown)} are in no batch group: add them to BATCH_GROUPS")
    ids = [tokenizer.encode(p["prompt"], add_special_tokens=False) for p in prompts]
    batches = []
    for group in BATCH_GROUPS:
        members = [i for i, p in enumerate(prompts) if p["kind"] in group]
        ordered = [ids[i] for i in sorted(members, key=lambda i: (len(ids[i]), i))]
        batches += [ordered[i : i + plan.batch_size] for i in range(0, len(ordered), plan.batch_size)]
    return batches


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
    stops = sorted(tok.eos_token_ids)  # where the engine stops
    seed = plan.seed + (2 if sampled else 1)
    generated_tokens, stopped, seconds, reused, copied = 0, 0, 0.0, 0, 0
    for index, batch in enumerate(batches):
        # a chunk is valid for exactly its own input tokens, settings and generation recipe
        key = stage_key(
            tokens=[list(map(int, p)) for p in batch],
            length=plan.continuation_len,
            context=plan.context_len,
            sampling=dataclasses.asdict(sampling) if sampling else None,
            seed=seed,
            target=plan.target,
            stops=stops,
            recipe=GENERATION_RECIPE,
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
        answers = answer_prompts(target.runner, batch, plan.continuation_len, sampling, seed=seed, stop_ids=stops)
        windows = make_windows(batch, answers, plan.context_len, plan.continuation_len)
        buffer = io.BytesIO()
        np.savez(buffer, **windows.arrays(), key=np.array(key))
        atomic_write_bytes(path, buffer.getvalue())
        dt = time.perf_counter() - t0
        seconds += dt
        made = sum(len(a) for a in answers)
        generated_tokens += made
        stopped += sum(1 for a in answers if len(a) and int(a[-1]) in stops)
        log(
            f"{'sampled' if sampled else 'greedy'}: chunk {index + 1}/{len(batches)} "
            f"({len(batch)} prompts of {len(batch[0])}-{len(batch[-1])} tokens, {made} answer tokens) "
            f"in {dt:.1f}s, {made / dt:.1f} generated tokens/s"
        )
    windows = load_windows(out_dir, len(batches))
    return {
        "chunks": len(batches),
        "chunks_reused": reused,
        "chunks_copied_from_committed": copied,
        "sequences": len(windows),
        "sequence_length": plan.context_len + plan.continuation_len,
        "answer_tokens": int((windows.lengths - windows.starts).sum()),
        "answers_stopped_this_run": stopped,
        "generated_tokens_this_run": generated_tokens,
        "generated_tokens_per_second": round(generated_tokens / seconds, 2) if seconds else None,
        "sha256": windows.digest(),
    }


def load_windows(out_dir: Path, chunks: int) -> Windows:
    """The chunks' windows in chunk order."""
    parts = []
    for index in range(chunks):
        with np.load(Path(out_dir) / f"chunk_{index:05d}.npz") as data:
            parts.append(Windows.from_arrays(data))
    return Windows.concatenate(parts)


def load_sequences(out_dir: Path, chunks: int) -> np.ndarray:
    """int32 [n, context_len + continuation_len]: the chunks' windows' tokens in chunk order."""
    return load_windows(out_dir, chunks).sequences


def window_features(runner, windows: Windows, taps: list[int], final: bool = False):
    """(features [n, S, T*H], final-normed last hidden [n, S, H] or None) of the windows, from
    one forward over each row's whole prompt + answer (filled after its end, so every row of a
    batch has one length; the fill comes after the real tokens, and the target is causal). A
    window's positions after its length hold zeros."""
    import mlx.core as mx

    from dflash2_mlx.training.drafter.features import TargetFeatures

    whole = [windows.whole(i) for i in range(len(windows))]
    tokens = np.full((len(whole), max(len(w) for w in whole)), FILL, dtype=np.int32)
    for row, w in enumerate(whole):
        tokens[row, : len(w)] = w
    feats, last = TargetFeatures(runner, tokens, taps, budget=1 << 62, final=final).cached
    width = windows.sequences.shape[1]
    out = []
    for array in (feats, last) if final else (feats,):
        rows = []
        for i in range(len(windows)):
            begin, real = windows.offset(i), int(windows.lengths[i])
            row = array[i, begin : begin + real]
            rows.append(mx.pad(row, [(0, width - real), (0, 0)]))
        out.append(mx.stack(rows))
    mx.eval(out)
    return out[0], (out[1] if final else None)


def compute_features(plan: SmolPlan, target, windows: Windows, out_dir: Path, log: Callable[[str], None]) -> dict:
    """The target's tapped features (and final-normed hidden state, for soft targets) of every
    training window, from its whole prompt and answer (``window_features``), one
    ``features_NNNNN.npz`` per batch in ``out_dir``; chunks of the same windows and taps are
    kept. The trainer would need them before its first step; on disk a resumed training run does
    not pay this pass again."""
    taps = list(plan.drafter_taps)
    chunks = range(0, len(windows), plan.batch_size)
    reused, seconds = 0, 0.0
    for index, start in enumerate(chunks):
        part = windows[start : start + plan.batch_size]
        key = stage_key(tokens=part.digest(), taps=taps, target=plan.target, recipe=FEATURES_RECIPE)
        path = out_dir / f"features_{index:05d}.npz"
        if _chunk_done(path, key):
            reused += 1
            continue
        t0 = time.perf_counter()
        feats, final = window_features(target.runner, part, taps, final=True)
        buffer = io.BytesIO()
        np.savez(buffer, features=np.array(feats), final=np.array(final), key=np.array(key), lengths=part.lengths)
        atomic_write_bytes(path, buffer.getvalue())
        dt = time.perf_counter() - t0
        seconds += dt
        fed = sum(len(part.whole(i)) for i in range(len(part)))
        log(f"features: chunk {index + 1}/{len(chunks)} in {dt:.1f}s, {fed / dt:.0f} tokens/s")
    return {"chunks": len(chunks), "chunks_reused": reused, "seconds_this_run": round(seconds, 1)}


def load_features(plan: SmolPlan, target, windows: Windows, out_dir: Path, chunks: int):
    """``TargetFeatures`` of ``windows`` read back from ``compute_features``'s chunk files."""
    import mlx.core as mx

    from dflash2_mlx.training.drafter.features import TargetFeatures

    feats, finals = [], []
    for index in range(chunks):
        with np.load(Path(out_dir) / f"features_{index:05d}.npz") as data:
            feats.append(mx.array(data["features"]))
            finals.append(mx.array(data["final"]))
    features, final = mx.concatenate(feats), mx.concatenate(finals)
    del feats, finals
    mx.eval(features, final)
    return TargetFeatures.from_arrays(target.runner, windows.sequences, list(plan.drafter_taps), features, final)


def drafter_bytes(drafter_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(drafter_dir).glob("*.safetensors"))


def training_config(plan: SmolPlan, target, stop_at_step: Optional[int] = None):
    """The trainer's DrafterTrainingConfig for the plan's drafter (taps checked against ``target``)."""
    from dflash2_mlx.training.drafter.config import DrafterTrainingConfig

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

    from dflash2_mlx.training.drafter.initialise import init_drafter, make_drafter_config

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
    windows: Windows,
    out_dir: Path,
    log: Callable[[str], None],
    progress: bool = False,
    features=None,
    stop_at_step: Optional[int] = None,
    draft_vocab: Optional[np.ndarray] = None,
) -> dict:
    """Train (or resume training) the drafter in ``out_dir`` on ``windows`` with soft targets
    (``features``: the target's taps of the windows computed before, see ``load_features``;
    ``draft_vocab``: the token ids the drafter scores, trained on as it will draft)."""
    from dflash2_mlx.training.drafter.trainer import train_drafter

    cfg = training_config(plan, target, stop_at_step)
    t0 = time.perf_counter()
    train_drafter(
        target,
        windows.sequences,
        out_dir,
        cfg,
        continuation_start=windows.starts,
        lengths=windows.lengths,
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
