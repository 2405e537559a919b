"""A draft vocabulary for a DFlash 2 drafter: the token ids its head scores.

The drafter shares the target's head. On a small target that head is most of a draft's cost
(SmolLM2-135M: 49152 x 576, a fifth of the model, read once per draft), yet the target's answers
use a few thousand distinct tokens (SmolLM2's 252,672 generated training tokens: 6695). A drafter restricted to
them drafts as well and costs much less; decoding stays lossless (``Drafter.set_draft_vocab``).

The ids: every token of the target's own continuations (the drafter's training data, never the
held-out prompts), most frequent first, then the lowest ids not yet taken (BPE merges are ranked
by frequency, and the special tokens come first) until ``size``.

    python -m dflash2_mlx.training.drafter.draft_vocab DRAFTER_DIR --continuations WORK/continuations \
        --start 64 --size 8192

rewrites DRAFTER_DIR's model.safetensors (with a ``draft_vocab`` tensor), config.json
(``dflash_config.draft_vocab_size``) and MANIFEST.json (the files' digests and the coverage).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

import mlx.core as mx
import numpy as np

from dflash2_mlx.backend.files import atomic_write_text, sha256_file
from dflash2_mlx.models.drafter import DRAFT_VOCAB_KEY


def continuation_token_counts(chunk_dirs: Iterable[Path], start: int) -> Counter:
    """How often each token id occurs in the generated part of the build's continuation chunks
    (``chunk_*.npz``: each row's answer, from its ``starts`` to its ``lengths``; in chunks without
    them, made before issue 40, ``sequences`` [N, L] are the prompt's last ``start`` tokens, then
    the target's continuation)."""
    counts: Counter = Counter()
    chunk_dirs = list(chunk_dirs)
    for directory in chunk_dirs:
        for chunk in sorted(Path(directory).glob("**/chunk_*.npz")):
            with np.load(chunk) as data:
                sequences = np.asarray(data["sequences"])
                if "lengths" in data.files:
                    for row, begin, end in zip(sequences, data["starts"], data["lengths"]):
                        counts.update(row[begin:end].tolist())
                else:
                    counts.update(sequences[:, start:].ravel().tolist())
    if not counts:
        raise ValueError(f"no continuation chunks (chunk_*.npz) under {[str(d) for d in chunk_dirs]}")
    return counts


def choose_draft_vocab(counts: Counter, size: int, vocab_size: int) -> np.ndarray:
    """``size`` token ids, sorted: the most frequent counted ones, then the lowest ids left."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"a draft vocabulary of {size} ids does not fit a vocabulary of {vocab_size}")
    chosen = [token for token, _ in counts.most_common() if 0 <= token < vocab_size][:size]
    taken = set(chosen)
    for token in range(vocab_size):
        if len(chosen) == size:
            break
        if token not in taken:
            chosen.append(token)
    return np.array(sorted(chosen), dtype=np.int32)


def coverage(counts: Counter, ids: np.ndarray) -> float:
    """The share of the counted tokens that the draft vocabulary holds."""
    inside = set(ids.tolist())
    return sum(n for token, n in counts.items() if token in inside) / sum(counts.values())


def vocab_record(counts: Counter, ids: np.ndarray) -> dict:
    """What MANIFEST.json says of a draft vocabulary chosen from ``counts``."""
    return {
        "size": int(len(ids)),
        "distinct_training_tokens": len(counts),
        "training_tokens": int(sum(counts.values())),
        "training_coverage": round(coverage(counts, ids), 6),
        "rule": "every token of the target's continuations, most frequent first, then the lowest ids",
    }


def write_draft_vocab(drafter_dir: Path, ids: Optional[np.ndarray], record: Optional[dict] = None) -> None:
    """Store ``ids`` as the drafter's draft vocabulary (None removes it), with its config.json and
    MANIFEST.json (if any) updated to match."""
    drafter_dir = Path(drafter_dir)
    weights_file, config_file = drafter_dir / "model.safetensors", drafter_dir / "config.json"
    weights = dict(mx.load(str(weights_file)))
    weights.pop(DRAFT_VOCAB_KEY, None)
    config = json.loads(config_file.read_text())
    dflash = config.setdefault("dflash_config", {})
    dflash.pop("draft_vocab_size", None)
    if ids is not None:
        weights[DRAFT_VOCAB_KEY] = mx.array(np.asarray(ids, dtype=np.int32))
        dflash["draft_vocab_size"] = int(len(ids))
    partial = weights_file.with_suffix(".partial.safetensors")
    mx.save_safetensors(str(partial), weights, metadata={"format": "mlx"})
    partial.replace(weights_file)
    atomic_write_text(config_file, json.dumps(config, indent=2) + "\n")
    manifest_file = drafter_dir / "MANIFEST.json"
    if manifest_file.exists():
        manifest = json.loads(manifest_file.read_text())
        files = manifest.setdefault("files", {})
        for name in ("model.safetensors", "config.json"):
            files[name] = sha256_file(drafter_dir / name)
        if ids is None:
            manifest.pop("draft_vocab", None)
        else:
            manifest["draft_vocab"] = record or {"size": int(len(ids))}
        atomic_write_text(manifest_file, json.dumps(manifest, indent=1) + "\n")


def add_draft_vocab(drafter_dir: Path, chunk_dirs: Iterable[Path], start: int, size: int) -> dict:
    """Choose a draft vocabulary of at most ``size`` ids from the continuation chunks under
    ``chunk_dirs`` (generated part from ``start``), store it in ``drafter_dir`` and return its
    MANIFEST.json record (the build and this module's command both do it this way)."""
    vocab_size = int(json.loads((Path(drafter_dir) / "config.json").read_text())["vocab_size"])
    counts = continuation_token_counts(chunk_dirs, start)
    ids = choose_draft_vocab(counts, min(size, vocab_size), vocab_size)
    record = vocab_record(counts, ids)
    write_draft_vocab(drafter_dir, ids, record)
    return record


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", type=Path, help="the DFlash 2 drafter directory to rewrite")
    ap.add_argument("--continuations", type=Path, nargs="+", required=True, help="directories of chunk_*.npz")
    ap.add_argument("--start", type=int, required=True, help="where the continuation begins (the plan's context_len)")
    ap.add_argument("--size", type=int, default=8192, help="how many token ids (default 8192)")
    ap.add_argument("--remove", action="store_true", help="remove the drafter's draft vocabulary instead")
    args = ap.parse_args(argv)
    if args.remove:
        write_draft_vocab(args.drafter, None)
        print(f"{args.drafter}: the drafter scores the whole vocabulary again")
        return 0
    record = add_draft_vocab(args.drafter, args.continuations, args.start, args.size)
    print(
        f"{args.drafter}: draft vocabulary of {record['size']} ids ({record['distinct_training_tokens']} distinct "
        f"tokens in {record['training_tokens']} training tokens; coverage {record['training_coverage']:.4f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
