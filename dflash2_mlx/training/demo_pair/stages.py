"""The stages of the demo pair's build, in order: corpus, tokenizer, documents, target, drafter.

Each stage takes the ``BuildPlan`` and what the stages before it produced, logs what it did and
returns what the manifest records about it. The orchestration (reusing a finished target,
assembling the assets, the manifest) is ``build_demo_pair.build``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "2")  # the tokenizers trainer; merges are order-independent anyway

import numpy as np  # noqa: E402

from dflash2_mlx.training import corpus as corpus_mod  # noqa: E402
from dflash2_mlx.training.build_common import Log  # noqa: E402
from dflash2_mlx.training.demo_pair import tokenizer as tok_mod  # noqa: E402
from dflash2_mlx.training.demo_pair.plan import DRAFTER_DIR, BuildPlan, generation_config  # noqa: E402

__all__ = [
    "build_corpus",
    "build_documents",
    "build_drafter",
    "build_target",
    "build_tokenizer",
    "drafter_data",
]


def build_corpus(plan: BuildPlan, log: Log):
    files = corpus_mod.load_corpus()
    unique = corpus_mod.deduplicate(files) if plan.deduplicate else files
    train, held = corpus_mod.split(unique)
    log(
        f"corpus: {len(files)} files, {len(files) - len(unique)} verbatim copies dropped "
        f"({len(train)} train, {len(held)} held out), "
        f"{sum(f.size for f in train) / 1e6:.2f} MB train, Python {sys.version.split()[0]}"
    )
    return files, train, held


def build_tokenizer(plan: BuildPlan, train, out_dir: Path, log: Log):
    tok = tok_mod.train_tokenizer([f.text for f in train], vocab_size=plan.vocab_size)
    tok_mod.save_tokenizer(tok, out_dir)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, specials {tok_mod.special_ids(tok)}")
    return tok


def build_documents(plan: BuildPlan, tok, train, held, log: Log):
    """Training documents (one per file, then the chat examples) and held-out documents."""
    file_docs = tok_mod.encode_plain(tok, [f.text for f in train])
    chat, seen = [], set()
    for f in train:
        for user, answer in corpus_mod.function_examples(f, plan.chat_percent, plan.chat_max_lines, plan.chat_requests):
            if not plan.deduplicate or (user, answer) not in seen:  # the same function in two files is one example
                seen.add((user, answer))
                chat.append((user, answer))
    if plan.json_percent:
        for f in train:
            for user, answer in corpus_mod.json_examples(f, plan.json_percent):
                if not plan.deduplicate or (user, answer) not in seen:
                    seen.add((user, answer))
                    chat.append((user, answer))
    chat_docs = tok_mod.chat_ids_batch(tok, chat)
    held_docs = tok_mod.encode_plain(tok, [f.text for f in held])
    n_file, n_chat = sum(map(len, file_docs)), sum(map(len, chat_docs))
    log(
        f"documents: {n_file} file tokens + {n_chat} chat-example tokens ({len(chat_docs)} examples), "
        f"{sum(map(len, held_docs))} held-out tokens"
    )
    stats = {
        "train_file_tokens": n_file,
        "train_chat_tokens": n_chat,
        "chat_examples": len(chat_docs),
        "heldout_tokens": sum(map(len, held_docs)),
    }
    return file_docs + chat_docs, held_docs, stats


def build_target(plan: BuildPlan, tok, docs, held_docs, tok_dir: Path, out_dir: Path, log: Log) -> dict:
    from dflash2_mlx.training.demo_pair import target_trainer as tt

    eos = tok.token_to_id(tok_mod.EOS)
    im_end = tok.token_to_id(tok_mod.IM_END)
    config = tt.model_config(tok.get_vocab_size(), [eos, im_end], **plan.target_model)
    config["text_config"]["eos_token_id"] = eos
    size = tt.float32_bytes(config)
    log(f"target: {size / 1e6:.2f} MB float32, config {plan.target_model}")
    train_seqs = tt.pack_documents(docs, plan.seq_len, eos)
    held_seqs = tt.pack_documents(held_docs, plan.seq_len, eos)
    if plan.heldout_eval_sequences is not None:
        held_seqs = held_seqs[: plan.heldout_eval_sequences]
    tcfg = tt.TargetTrainingConfig(
        steps=plan.target_steps,
        batch_size=plan.target_batch,
        seq_len=plan.seq_len,
        learning_rate=plan.target_lr,
        warmup_steps=plan.target_warmup,
        seed=plan.seed,
    )
    model = tt.build_model(config, seed=plan.seed)
    t0 = time.perf_counter()
    history = tt.train_target(model, train_seqs, tcfg, log=log, log_every=max(1, min(25, plan.target_steps // 4)))
    seconds = time.perf_counter() - t0
    held_loss = tt.evaluate_loss(model, held_seqs, batch_size=16)
    log(
        f"target: trained {plan.target_steps} steps in {seconds:.0f}s; held-out loss {held_loss:.4f} "
        f"(perplexity {np.exp(held_loss):.2f}) over {held_seqs.shape[0] * plan.seq_len} tokens"
    )
    (tok_dir / "generation_config.json").write_text(json.dumps(generation_config([eos, im_end]), indent=2) + "\n")
    tt.save_target(model, config, tok_dir, out_dir)
    return {
        "config": config,
        "model": plan.target_model,
        "parameters": tt.parameter_count(model),
        "float32_bytes": size,
        "training": tcfg.to_dict(),
        "training_tokens": plan.target_steps * plan.target_batch * plan.seq_len,
        "train_sequences": int(train_seqs.shape[0]),
        "epochs": round(plan.target_steps * plan.target_batch / train_seqs.shape[0], 3),
        "loss_history": history,
        "final_train_loss": history[-1]["loss"] if history else None,
        "heldout_loss": held_loss,
        "heldout_perplexity": float(np.exp(held_loss)),
        "heldout_tokens_evaluated": int(held_seqs.shape[0] * plan.seq_len),
        "train_seconds": round(seconds, 1),
    }


def drafter_data(plan: BuildPlan, target, docs) -> np.ndarray:
    """The drafter's training sequences [N, prefix_len + continuation_len]: corpus prefixes with
    the target's greedy continuations (seed plan.seed + 1), then sampled ones (plan.seed + 2)."""
    from dflash2_mlx.training.drafter.data import generate_training_sequences

    seqs = generate_training_sequences(
        target,
        docs,
        plan.drafter_sequences,
        plan.prefix_len,
        plan.continuation_len,
        plan.seed + 1,
    )
    if plan.drafter_sampled_sequences:
        sampled = generate_training_sequences(
            target,
            docs,
            plan.drafter_sampled_sequences,
            plan.prefix_len,
            plan.continuation_len,
            plan.seed + 2,
            temperature=plan.drafter_sample_temperature,
        )
        seqs = np.concatenate([seqs, sampled])
    return seqs


def build_drafter(plan: BuildPlan, target, docs, work: Path, log: Log) -> dict:
    try:
        from dflash2_mlx.training.drafter.config import DrafterTrainingConfig
        from dflash2_mlx.training.drafter.trainer import train_drafter
    except ImportError as e:
        raise SystemExit(
            f"the drafter trainer is not available ({e}); the target is built, the drafter is not"
        ) from None
    t0 = time.perf_counter()
    seqs = drafter_data(plan, target, docs)
    gen_seconds = time.perf_counter() - t0
    log(
        f"drafter data: {seqs.shape[0]} sequences ({plan.drafter_sampled_sequences} sampled at "
        f"t={plan.drafter_sample_temperature}) of {plan.prefix_len} corpus + {plan.continuation_len} "
        f"generated tokens in {gen_seconds:.0f}s"
    )
    cfg = DrafterTrainingConfig(
        block_size=plan.drafter_block_size,
        layers=plan.drafter_layers,
        steps=plan.drafter_steps,
        seed=plan.seed,
        convs=True,
        selector=True,
        target_layer_ids=list(plan.drafter_taps),
        **plan.drafter_options,
    )
    out = work / DRAFTER_DIR
    if out.exists():
        shutil.rmtree(out)  # never resume a half-finished run silently: the build starts clean
    t0 = time.perf_counter()
    train_drafter(target, seqs, out, cfg, continuation_start=plan.prefix_len, progress=sys.stderr.isatty())
    train_seconds = time.perf_counter() - t0
    log(f"drafter: trained {plan.drafter_steps} steps in {train_seconds:.0f}s")
    state = {}
    state_file = out / "training_state" / "state.json"
    if state_file.exists():
        try:
            state = json.loads(state_file.read_text())
        except json.JSONDecodeError:
            state = {}
    return {
        "training": {k: v for k, v in dataclasses.asdict(cfg).items()},
        "data": {
            "sequences": int(seqs.shape[0]),
            "sampled_sequences": plan.drafter_sampled_sequences,
            "sample_temperature": plan.drafter_sample_temperature,
            "prefix_len": plan.prefix_len,
            "continuation_len": plan.continuation_len,
            "seed": plan.seed + 1,
            "sha256": hashlib.sha256(np.ascontiguousarray(seqs).tobytes()).hexdigest(),
        },
        "loss_history": state.get("history", []),
        "generation_seconds": round(gen_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "dir": out,
    }
