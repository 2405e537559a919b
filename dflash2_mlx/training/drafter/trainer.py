"""Train a DFlash 2 (or DFlash 1) drafter against a frozen target, with the DFlash recipe.

This module holds ``train_drafter``, the training loop. Its pieces live beside it, one job each:
``config`` (the settings), ``initialise`` (the drafter's config and initialisation), ``batches``
(one step's seeded data), ``features`` (the frozen target's taps), ``loss``, ``checkpoint`` (save
and resume), ``schedule`` (learning rate, progress line) and ``evaluation`` (held-out acceptance).

The recipe
----------
- Data: sequences whose tail is the target's own greedy continuation (``data.py``). Anchors are
  drawn per sequence and step, uniformly among positions ``a`` with ``a >= max(1,
  continuation_start)`` (inside the generated part, with at least one context row) and
  ``a + B - 1 < S`` (room for the block). Rows may start their answers at different positions
  (``continuation_start`` per row) and end early (``lengths``: an answer stopped at its end
  token, then filler): anchors lie before a row's last real token, and a block's rows whose
  label lies past it count in no loss (the engine stops at the end token).
- Block: ``[seq[a], MASK, ..., MASK]`` at positions a..a+B-1, embedded with the target's frozen
  embedding (times ``input_embedding_scale``). Context: the target's tapped hidden states of the
  positions strictly before ``a`` (computed once by the frozen target, no gradient).
  ``Drafter.train_forward`` gives every block exactly what inference shows it: its own context
  prefix (within the sliding window) and its own rows both ways, never another block.
- Labels: row i (1..B-1) predicts ``seq[a + i]``, the target's own greedy output. Loss:
  cross-entropy on rows 1..B-1 weighted by ``exp(-(i - 1) / gamma)``, weights normalised to sum
  to one per block, averaged over blocks.
- Selector (DFlash 2): row i's candidates are the top-k of its (stop-gradient) drafter logits,
  its predecessor is the true token of row i-1 (the anchor for row 1, as in the greedy walk up to
  the first miss), scores ``unary + <pred_cb[pred] * hidden_projection(h_i), succ_cb[cand]>``;
  cross-entropy against the index of the true label among the candidates, rows whose label is
  not among them masked out, with the same row weights, added with ``selector_loss_weight``.
  By default the selector loss does not reach the drafter (``selector_grad_to_drafter=False``):
  the unary scores and h_i are stop-gradient, so the selector is a pure re-ranker that learns the
  pair correction log p(b | a, h) - log p(b | h) on top of whatever the drafter proposes, and the
  drafter is shaped by the cross-entropy alone. The selector's gradients are also clipped on
  their own, so a DFlash 2 run trains bit for bit the drafter its selector-off ablation trains.
  Measured on a byte-level tiny target (B = 8, 600 steps, held-out anchor-mean tau): detached
  6.17, joint 6.08; at 300 steps joint led by 0.1. No gain worth losing the clean ablation.
- Initialisation: identity convolutions (``base_kernel[:, 0] = 1``, ``[:, 1] = 0``), zero dynamic
  projections, zero successor codebook, small random predecessor codebook and hidden projection;
  every other layer MLX's default init, norms ones. The frozen target's embedding and LM head
  are shared: the checkpoint has neither.
- Optimiser: AdamW (betas 0.9 / 0.95, bias correction), linear warmup then cosine decay,
  gradient-norm clipping (drafter and selector each on their own). The step is ``mx.compile``d
  (about 8% faster than eager at the embedded pair's widths on this CPU; same weights to 1e-5).

Ablations at equal budget ("DFlash 1", "+ selector", "+ convs", "+ both")
----------------------------------------------------------------------------
- both off: a real DFlash 1 checkpoint (``DFlashDraftModel``: no convs, no selector tensors).
- convs off (``convs=False``): a DFlash 2 checkpoint whose convolutions are frozen at the identity
  (tap 0 = 1, tap 1 = 0, zero dynamic projection). ``1 * x_t + 0 * x_(t-1)`` is exactly ``x_t``,
  so the network computes bit for bit what a drafter without convs computes; it stays loadable by
  everything that loads DFlash 2 (it pays the identity convs' small cost at inference).
- selector off (``selector=False``): a DFlash 2 checkpoint whose selector is frozen at zero
  (codebooks and projection). Every pair score is then exactly the unary logit, so the greedy
  walk is the drafter's per-row argmax (top-k is sorted, first maximum): DFlash 1's greedy
  proposal. With sampling it proposes softmax(logits / T) truncated to the top-k, which is what a
  DFlash 2 engine does without a trained selector; acceptance tables at temperature 0 are exact.
  No selector loss is computed.

Measured (a byte-level 128-wide 4-layer tiny target trained briefly on Python source, 1024
sequences of 64 corpus + 24 generated tokens, 600 steps, B = 8, held-out greedy tokens per cycle
from ``evaluate_drafter``): DFlash 1 4.16, + selector 4.69, + convs 5.08, + both 5.20.

Checkpoints and resume
----------------------
``out_dir`` gets ``config.json`` + ``model.safetensors`` in the real layout (float32; loadable by
``loading.load_drafter`` and z-lab's ``DFlash2DraftModel.from_pretrained``) every
``checkpoint_every`` steps, at the end, and when interrupted (Ctrl-C). The optimiser state and the
step live in ``out_dir/training_state/`` (a subdirectory, so no loader ever globs them as weights).
Calling ``train_drafter`` again on the same ``out_dir`` resumes: all randomness is derived from
``(seed, step)``, so a run stopped after k steps and resumed gives bit for bit the weights of an
uninterrupted run with the same step budget. ``minutes`` budgets (and ``stop_at_step``) end a
run by the clock / at a step; the schedule of a minutes run follows elapsed time, so such a run is
not deterministic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from dflash2_mlx.backend.progress import ProgressBar
from dflash2_mlx.models.drafter_config import DFLASH2, DrafterConfig
from dflash2_mlx.training.drafter.batches import (
    anchor_range,
    answer_ends,
    batch_indices,
    block_arrays,
    label_mask,
    loss_weights,
    per_sequence,
    sample_anchors,
    step_rng,
)
from dflash2_mlx.training.drafter.checkpoint import (
    checkpoint_tensors,
    config_record,
    data_fingerprint,
    load_checkpoint_state,
    resume_checkpoint,
    save_checkpoint,
)
from dflash2_mlx.training.drafter.config import RESUMABLE_CHANGES, DrafterTrainingConfig
from dflash2_mlx.training.drafter.features import TargetFeatures
from dflash2_mlx.training.drafter.initialise import (
    drafter_from_init,
    freeze_ablations,
    init_drafter,
    make_drafter_config,
)
from dflash2_mlx.training.drafter.loss import block_target_logits, drafter_head, drafter_loss, forward_blocks, summarize
from dflash2_mlx.training.drafter.schedule import format_progress, learning_rate_at

__all__ = ["train_drafter"]


def train_drafter(
    target,
    sequences: np.ndarray,
    out_dir: Path,
    config: DrafterTrainingConfig,
    init: Optional[Path] = None,
    continuation_start=0,
    progress: bool = True,
    features: Optional[TargetFeatures] = None,
    draft_vocab: Optional[np.ndarray] = None,
    max_bytes: Optional[int] = None,
    lengths: Optional[np.ndarray] = None,
) -> Path:
    """Train a drafter on ``sequences`` (int32 [n, S], ideally from ``generate_training_sequences``).

    ``target`` is a ``loading.Target`` (frozen; its embedding and LM head are shared). Anchors are
    drawn at positions >= ``continuation_start`` (an int, or one per sequence: where its answer
    begins) with room for the block. ``lengths`` [n] (default: all of each row): how many tokens
    of each row are real, the prompt part then the answer up to and including its end token;
    what follows is filler. Anchors lie before a row's last real token, and rows of a block whose
    label lies past it (or past an ``answer_end_token_ids`` token) are not trained on. Writes ``out_dir``
    (config.json + model.safetensors in the real layout, training_state/ for resume) and returns
    it; an ``out_dir`` holding a run's state resumes that run. Deterministic for a fixed seed and
    step budget; a ``minutes`` budget is not. ``features`` (``TargetFeatures.from_arrays``) are
    the target's taps of ``sequences`` computed before, e.g. kept on disk by a staged build, so a
    resumed run does not compute them again.

    ``draft_vocab`` (sorted distinct token ids, DFlash 2): the drafter trains as it will draft,
    scoring only those ids (``Drafter.set_draft_vocab``); its cross-entropy and soft targets are
    taken over them, and the checkpoint carries them. On a small target the LM head over every
    block row is most of a step (SmolLM2: 49152 columns against 8192).

    ``max_bytes``: the checkpoint's size budget (a packaged drafter's), checked before the first
    step, so that a drafter too big to ship does not train first.
    """
    config.validate()
    out_dir = Path(out_dir)
    sequences = np.ascontiguousarray(np.asarray(sequences, dtype=np.int32))
    if sequences.ndim != 2 or sequences.shape[0] < 1:
        raise ValueError(f"sequences must be a non-empty [n, S] array of token ids, got shape {sequences.shape}")
    runner = target.runner
    n_seq, seq_len = sequences.shape
    starts = per_sequence(continuation_start, n_seq, "continuation_start")
    anchor_range(seq_len, config.block_size, int(starts.max()))  # fail early with a clear message
    if runner.vocab_size and (sequences.min() < 0 or sequences.max() >= runner.vocab_size):
        raise ValueError(f"sequences hold token ids outside the target's vocabulary (size {runner.vocab_size})")
    fingerprint = data_fingerprint(sequences, continuation_start, lengths)
    # each row's trainable length: its real tokens, up to and including its first end token
    valid_lengths = per_sequence(seq_len if lengths is None else lengths, n_seq, "lengths")
    if (valid_lengths > seq_len).any() or (valid_lengths <= starts).any():
        raise ValueError("every row's length must lie after its continuation_start and within the row")
    valid_lengths = np.minimum(valid_lengths, answer_ends(sequences, starts, config.answer_end_token_ids) + 1)
    vocab = None if draft_vocab is None else _checked_draft_vocab(draft_vocab, runner.vocab_size, config)

    previous = load_checkpoint_state(out_dir)
    if previous is not None:
        old = previous.get("config", {})
        # a setting added after the run started reads as its default (the run trained with it)
        defaults = config_record(DrafterTrainingConfig())
        changed = sorted(
            k
            for k, v in config_record(config).items()
            if k not in RESUMABLE_CHANGES and old.get(k, defaults.get(k)) != v
        )
        if changed:
            raise ValueError(
                f"{out_dir} holds a run with other settings ({', '.join(changed)}); resume it with the same "
                "settings or pick another output directory"
            )
        if previous.get("data_sha256") != fingerprint:
            raise ValueError(f"{out_dir} holds a run trained on other data; pick another output directory")
        drafter_config = DrafterConfig.from_dict(json.loads((out_dir / "config.json").read_text()))
        if drafter_config.draft_vocab_size != (0 if vocab is None else len(vocab)):
            raise ValueError(f"{out_dir} holds a run with another draft vocabulary; pick another output directory")
        drafter = init_drafter(drafter_config, config)
    elif init is not None:
        drafter = drafter_from_init(target, Path(init), config)
        drafter_config = drafter.config
    else:
        drafter_config = make_drafter_config(target, config)
        if vocab is not None:
            drafter_config = dataclasses.replace(drafter_config, draft_vocab_size=len(vocab))
        drafter = init_drafter(drafter_config, config)
    if vocab is not None:
        if drafter_config.draft_vocab_size != len(vocab):
            raise ValueError("a draft vocabulary is given for training, but the initial drafter has none")
        drafter.set_draft_vocab(mx.array(vocab))
    from dflash2_mlx.models.loading import validate_pair

    validate_pair(runner, drafter_config)
    if max_bytes is not None:
        size = sum(v.nbytes for v in checkpoint_tensors(drafter).values())
        if size > max_bytes:
            raise ValueError(
                f"this drafter's weights take {size / 1e6:.1f} MB, over the {max_bytes / 1e6:.0f} MB budget: "
                "train fewer layers or a smaller draft vocabulary, or raise the budget"
            )
    freeze_ablations(drafter, config)
    drafter.train()

    optimizer = optim.AdamW(
        learning_rate=config.learning_rate, betas=[0.9, 0.95], weight_decay=config.weight_decay, bias_correction=True
    )
    optimizer.init(drafter.trainable_parameters())
    step, elapsed, history = 0, 0.0, []
    if previous is not None:
        resume_checkpoint(out_dir, previous, drafter, optimizer)
        step, elapsed = int(previous["step"]), float(previous.get("elapsed", 0.0))
        history = list(previous.get("history", []))

    total_steps = config.total_steps
    budget = None if config.minutes is None else 60.0 * config.minutes
    stop_at = total_steps
    if config.stop_at_step is not None:
        stop_at = config.stop_at_step if stop_at is None else min(stop_at, config.stop_at_step)

    weights = mx.array(loss_weights(drafter_config.block_size, config.resolved_gamma()))
    soft = config.soft_target_weight > 0
    if features is None:
        features = TargetFeatures(
            runner, sequences, drafter_config.target_layer_ids, config.feature_cache_bytes, final=soft
        )
    elif (
        features.taps != list(drafter_config.target_layer_ids)
        or features.final != soft
        or features.sequences.shape != sequences.shape
    ):
        raise ValueError("the given features were computed for other taps, sequences or soft-target setting")
    # the drafter's head, also the soft targets' columns: the draft vocabulary's, or every id
    lm_head, column_of = drafter_head(runner, drafter)

    def loss_fn(feats, final, blocks, anchors, labels, preds, valid):
        hidden = forward_blocks(drafter, runner.embed, feats, blocks, anchors)
        M = hidden.shape[0]
        target_logits = None
        if final is not None:
            target_logits = block_target_logits(lm_head, final, anchors, drafter_config.block_size)
        return drafter_loss(
            drafter,
            lm_head,
            hidden,
            labels.reshape(M, -1),
            preds.reshape(M, -1),
            weights,
            config,
            target_logits,
            valid.reshape(M, -1),
        )

    loss_and_grad = nn.value_and_grad(drafter, loss_fn)

    def train_step(feats, final, blocks, anchors, labels, preds, valid):
        (loss, metrics), grads = loss_and_grad(feats, final, blocks, anchors, labels, preds, valid)
        # The selector's gradients are clipped on their own: with the default (detached) selector
        # loss the drafter's trajectory is then exactly that of a run without the selector, so
        # the ablations "+ convs" and "+ both" share one drafter and differ only in the selector.
        selector_grads = grads.pop("candidate_selector", None)
        grads, norm = optim.clip_grad_norm(grads, config.grad_clip)
        metrics["grad_norm"] = norm
        if selector_grads is not None and tree_flatten(selector_grads):
            clipped, metrics["selector_grad_norm"] = optim.clip_grad_norm(selector_grads, config.grad_clip)
            grads["candidate_selector"] = clipped
        optimizer.update(drafter, grads)
        return metrics

    if config.compile:
        state = [drafter.state, optimizer.state]
        train_step = mx.compile(train_step, inputs=state, outputs=state)

    def record(step_now: int, complete: bool) -> dict:
        return {
            "step": step_now,
            "elapsed": elapsed,
            "complete": complete,
            "config": config_record(config),
            "data_sha256": fingerprint,
            "num_sequences": n_seq,
            "sequence_length": seq_len,
            "continuation_start": int(continuation_start) if np.ndim(continuation_start) == 0 else "per sequence",
            "target": target.name,
            "architecture": drafter_config.architecture,
            "history": history,
            "environment": {
                "python": sys.version.split()[0],
                "mlx": getattr(mx, "__version__", "?"),
                "platform": platform.platform(),
                "machine": platform.machine(),
            },
        }

    def finished() -> bool:
        if stop_at is not None and step >= stop_at:
            return True
        return budget is not None and elapsed >= budget

    if finished():
        if previous is None:
            save_checkpoint(out_dir, drafter, optimizer, record(step, True))
        return out_dir

    by_steps = total_steps is not None
    bar = ProgressBar(total_steps if by_steps else budget, "train", "" if by_steps else "s", enabled=progress)
    window: dict[str, float] = {}
    window_steps, window_time = 0, 0.0
    seq_tokens = config.batch_size * seq_len
    try:
        while not finished():
            t0 = time.perf_counter()
            rng = step_rng(config.seed, step)
            idx = batch_indices(n_seq, config.batch_size, config.seed, step)
            anchors = np.stack(
                [
                    sample_anchors(
                        rng,
                        seq_len,
                        drafter_config.block_size,
                        config.blocks_per_sequence,
                        int(starts[i]),
                        int(valid_lengths[i]) - 1,  # its end token's position, or its last token's
                    )
                    for i in idx
                ]
            )
            blocks, labels, preds = block_arrays(
                sequences[idx], anchors, drafter_config.block_size, drafter_config.mask_token_id
            )
            if total_steps is not None:
                fraction = step / total_steps
            else:
                fraction = elapsed / budget
            optimizer.learning_rate = learning_rate_at(config, fraction)
            metrics = train_step(
                *features(idx),
                mx.array(blocks),
                mx.array(anchors),
                mx.array(labels if column_of is None else column_of[labels]),
                mx.array(preds),
                mx.array(label_mask(anchors, drafter_config.block_size, valid_lengths[idx])),
            )
            mx.eval(metrics, drafter.parameters(), optimizer.state)
            dt = time.perf_counter() - t0
            step += 1
            elapsed += dt
            window_steps += 1
            window_time += dt
            values = summarize({k: float(v.item()) for k, v in metrics.items()}, config)
            if not math.isfinite(values["loss"]):
                raise FloatingPointError(f"the loss is {values['loss']} at step {step}; lower the learning rate")
            for k, v in values.items():
                window[k] = window.get(k, 0.0) + v
            if window_steps >= config.log_every or finished():
                m = {k: v / window_steps for k, v in window.items()}
                m["tok_s"] = seq_tokens * window_steps / window_time
                m["block_tok_s"] = m["tok_s"] / seq_len * config.blocks_per_sequence * (drafter_config.block_size - 1)
                m["steps_s"] = window_steps / window_time
                m["lr"] = float(optimizer.learning_rate.item())
                history.append({"step": step, **{k: round(v, 5) for k, v in m.items()}})
                done = step if by_steps else min(elapsed, budget)
                bar.update(done, format_progress(m) if by_steps else f"step {step}  " + format_progress(m))
                window, window_steps, window_time = {}, 0, 0.0
            if config.checkpoint_every and step % config.checkpoint_every == 0 and not finished():
                save_checkpoint(out_dir, drafter, optimizer, record(step, False))
    except KeyboardInterrupt:
        save_checkpoint(out_dir, drafter, optimizer, record(step, False))
        bar.close()
        raise
    bar.close()
    complete = (total_steps is not None and step >= total_steps) or (budget is not None and elapsed >= budget)
    save_checkpoint(out_dir, drafter, optimizer, record(step, complete))
    return out_dir


def _checked_draft_vocab(ids, vocab_size: int, config: DrafterTrainingConfig) -> np.ndarray:
    """The draft vocabulary to train with, as int32: a DFlash 2 drafter's, sorted distinct ids."""
    ids = np.asarray(ids)
    if config.architecture != DFLASH2:
        raise ValueError("a draft vocabulary needs a DFlash 2 drafter (its selector maps the ids back)")
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or len(ids) < config.selector_top_k:
        raise ValueError(f"a draft vocabulary is a list of at least {config.selector_top_k} token ids")
    if np.any(np.diff(ids) <= 0) or ids[0] < 0 or (vocab_size and ids[-1] >= vocab_size):
        raise ValueError(f"a draft vocabulary holds distinct token ids in increasing order, below {vocab_size}")
    return ids.astype(np.int32)
