"""`dflash2-mlx train-drafter`: train a DFlash 2 (or DFlash 1) drafter against a frozen target.

Registered by the app as ``app.command("train-drafter")(train_drafter_command)``. The corpus is
tokenized with the target's tokenizer; random windows of it become prompts that the target
continues greedily (its own output is what the drafter must learn to predict); the drafter is
trained on those continuations. Everything is written to --out: the drafter in the real layout
(config.json + model.safetensors) and training_state/ (the generated sequences, the corpus
record, the optimiser state) so that rerunning the same command resumes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from dflash2_mlx.backend.files import JsonlError, read_jsonl, sha256_file
from dflash2_mlx.cli.common import UserError

TEXT_SUFFIXES = (".txt", ".md")


def _user_error(message: str) -> Exception:
    """The app's one-line error type."""
    return UserError(message)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"data file {path} is not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"cannot read data file {path}: {e.strerror or e}") from None


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    try:
        records = read_jsonl(path, "data file")
    except JsonlError as e:
        raise ValueError(f'{e}; expected one {{"text": ...}} object per line') from None
    for number, record in records:
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{path}:{number}: no "text" string; expected one {{"text": ...}} object per line')
        texts.append(record["text"])
    return texts


def read_corpus(path: Path) -> tuple[list[str], list[dict]]:
    """(documents, file records with sha256) from a directory of text files, a .txt or a .jsonl."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(
            f"data path {path} does not exist; give a directory of .txt files, a .txt file or a .jsonl file"
        )
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in TEXT_SUFFIXES + (".jsonl",)
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"data directory {path} holds no .txt, .md or .jsonl files")
    else:
        files = [path]
    documents, records = [], []
    for f in files:
        if f.suffix.lower() == ".jsonl":
            documents += _read_jsonl(f)
        elif f.suffix.lower() in TEXT_SUFFIXES or f == path:
            documents.append(_read_text(f))
        records.append({"file": str(f), "sha256": sha256_file(f), "bytes": f.stat().st_size})
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise ValueError(f"data path {path} holds no text")
    return documents, records


def tokenize_documents(tokenizer, documents: list[str], min_len: int) -> list[list[int]]:
    """Token ids per document; documents shorter than ``min_len`` are packed together (blank-line separated)."""
    separator = list(tokenizer.encode("\n\n", add_special_tokens=False))
    out, pack = [], []
    for text in documents:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= min_len:
            out.append(ids)
            continue
        pack = pack + separator + ids if pack else ids
        if len(pack) >= min_len:
            out.append(pack)
            pack = []
    if pack:
        out.append(pack)
    return out


def _load_or_generate_sequences(
    target, documents, records, out: Path, num_sequences, prefix_len, continuation_len, seed, batch, progress
):
    """The target-generated sequences, cached in out/training_state so that a resumed run reuses them."""
    import numpy as np

    from dflash2_mlx.training.drafter.checkpoint import STATE_DIR
    from dflash2_mlx.training.drafter.data import generate_training_sequences

    key = {
        "target": target.name,
        "corpus": [r["sha256"] for r in records],
        "num_sequences": num_sequences,
        "prefix_len": prefix_len,
        "continuation_len": continuation_len,
        "seed": seed,
    }
    state_dir = out / STATE_DIR
    seq_path, meta_path = state_dir / "sequences.npy", state_dir / "data.json"
    if seq_path.exists() and meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("key") == key:
                return np.load(seq_path)
        except (OSError, ValueError):
            pass
    sequences = generate_training_sequences(
        target,
        documents,
        num_sequences,
        prefix_len,
        continuation_len,
        seed,
        batch_size=batch,
        progress=progress,
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / "sequences.partial.npy"
    np.save(tmp, sequences)
    tmp.replace(seq_path)
    meta_path.write_text(
        json.dumps(
            {
                "key": key,
                "files": records,
                "documents": len(documents),
                "python": sys.version.split()[0],
            },
            indent=2,
        )
    )
    return sequences


def train_drafter_command(
    model: str = typer.Option(
        ..., "--model", "-m", help="Target model (frozen): local directory or Hugging Face repo id."
    ),
    data: Path = typer.Option(
        ...,
        "--data",
        help='Corpus: a directory of .txt/.md/.jsonl files, a .txt file, or a .jsonl file with {"text": ...} lines.',
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output directory for the drafter; rerunning with the same --out resumes."
    ),
    init: Optional[str] = typer.Option(
        None, "--init", help="Start from this drafter (directory or repo id); a DFlash 1 drafter grows DFlash 2 parts."
    ),
    block_size: int = typer.Option(8, "--block-size", help="Block size B (anchor + B-1 drafted tokens)."),
    layers: int = typer.Option(2, "--layers", help="Drafter layers (ignored with --init: the init's count is kept)."),
    steps: Optional[int] = typer.Option(
        None, "--steps", help="Optimiser steps (default 1000 unless --minutes is given); deterministic for a seed."
    ),
    minutes: Optional[float] = typer.Option(
        None,
        "--minutes",
        help="Wall-clock budget; the schedule follows the clock, so the weights are NOT deterministic (use --steps for "
        "that).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for the corpus windows, initialisation, batches and anchors."),
    no_convs: bool = typer.Option(
        False, "--no-convs", help="No dynamic convolutions (frozen at identity: exactly a drafter without them)."
    ),
    no_selector: bool = typer.Option(
        False,
        "--no-selector",
        help="No candidate selector (frozen at zero: the walk is the per-row argmax). With --no-convs: a DFlash 1 "
        "drafter.",
    ),
    num_sequences: int = typer.Option(512, "--num-sequences", help="Training sequences to generate with the target."),
    prefix_len: int = typer.Option(64, "--prefix-len", help="Corpus tokens per sequence (the prompt)."),
    continuation_len: int = typer.Option(
        128, "--continuation-len", help="Tokens the target generates after each prompt (anchors lie here)."
    ),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per optimiser step."),
    blocks_per_sequence: int = typer.Option(
        16, "--blocks-per-sequence", help="Blocks (anchors) per sequence per step."
    ),
    learning_rate: float = typer.Option(3e-3, "--lr", help="Peak learning rate (AdamW, warmup + cosine decay)."),
    mask_token_id: Optional[int] = typer.Option(
        None, "--mask-token-id", help="Mask token id, when the tokenizer has no <|mask|> token."
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
) -> None:
    """Train a DFlash 2 drafter (DFlash 1 with --no-convs --no-selector) on the target's own greedy continuations."""
    from dflash2_mlx.models.loading import load_target
    from dflash2_mlx.training.drafter.checkpoint import load_checkpoint_state
    from dflash2_mlx.training.drafter.config import DrafterTrainingConfig
    from dflash2_mlx.training.drafter.trainer import train_drafter

    config = DrafterTrainingConfig(
        block_size=block_size,
        layers=layers,
        steps=steps,
        minutes=minutes,
        seed=seed,
        convs=not no_convs,
        selector=not no_selector,
        batch_size=batch_size,
        blocks_per_sequence=blocks_per_sequence,
        learning_rate=learning_rate,
        mask_token_id=mask_token_id,
    )
    progress = not no_progress
    try:
        config.validate()
        for name, value in (
            ("--num-sequences", num_sequences),
            ("--prefix-len", prefix_len),
            ("--continuation-len", continuation_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if continuation_len < block_size:
            raise ValueError(
                f"--continuation-len ({continuation_len}) must be at least --block-size ({block_size}): anchors lie "
                f"in the continuation"
            )
        out = Path(out).expanduser()
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; give a directory")
        if (
            out.is_dir()
            and any(out.iterdir())
            and load_checkpoint_state(out) is None
            and not (out / "training_state").exists()
        ):
            raise ValueError(f"--out {out} is not empty and holds no training run; give a new or empty directory")
        documents, records = read_corpus(data)
        target = load_target(model)
        init_path = _resolve_init(init) if init else None
        docs = tokenize_documents(target.tokenizer, documents, prefix_len)
        typer.echo(
            f"corpus: {len(records)} file(s), {len(documents)} document(s), {sum(map(len, docs))} tokens", err=True
        )
        sequences = _load_or_generate_sequences(
            target,
            docs,
            records,
            out,
            num_sequences,
            prefix_len,
            continuation_len,
            seed,
            32,
            progress,
        )
        held = min(32, len(sequences) // 20)  # a few sequences held out for the final evaluation
        previous = load_checkpoint_state(out)
        if previous is not None:
            typer.echo(f"resuming {out} from step {previous['step']}", err=True)
        try:
            train_drafter(
                target, sequences[held:], out, config, init=init_path, continuation_start=prefix_len, progress=progress
            )
        except KeyboardInterrupt:
            state = load_checkpoint_state(out)
            step = state["step"] if state else 0
            typer.echo(f"checkpoint saved at step {step} in {out}; rerun the same command to resume", err=True)
            raise
    except ValueError as e:  # LoadError (a RuntimeError) passes through: the app prints it as one line
        raise _user_error(str(e)) from None
    state = load_checkpoint_state(out) or {}
    summary = f"drafter written to {out} after {state.get('step', '?')} steps"
    if held:
        from dflash2_mlx.models.loading import load_drafter
        from dflash2_mlx.training.drafter.checkpoint import STATE_DIR
        from dflash2_mlx.training.drafter.evaluation import evaluate_drafter

        metrics = evaluate_drafter(target, load_drafter(str(out)), sequences[:held], continuation_start=prefix_len)
        (out / STATE_DIR / "eval.json").write_text(json.dumps({"held_out_sequences": held, **metrics}, indent=2))
        summary += (
            f"; held-out greedy acceptance length {metrics['acceptance']:.2f} at block size {block_size} "
            f"(over {metrics['cycles']} simulated cycles)"
        )
    typer.echo(summary, err=True)


def _resolve_init(init: str) -> Path:
    from dflash2_mlx.models.loading import resolve

    return resolve(init, "init drafter")
