"""SmolLM2 drafter ablations at an equal budget: depth (1 or 2 layers) and training block size (4 or 8).

    python benchmarks/smollm2_ablation.py --work WORK [--steps 700] [--variants base,layers1,block4]
                                          [--json out.json]

``WORK`` is a SmolLM2 build's work directory (``training/build_smollm2_drafter.py``): its prompts,
continuations and features stages are reused (run there first if missing; the continuations are
committed, so only the features pass runs on a fresh machine). Every variant is the full plan's
drafter with one knob changed, trained for ``--steps`` steps on the same data, with the same seed,
on the plan's draft vocabulary, into ``WORK/ablation/<variant>`` (a killed run resumes there).

Each is then scored on the held-out prompts' greedy answers (the target's own, 128 tokens, made
once into ``WORK/ablation/heldout_answers.npz``) with ``evaluate_drafter``: the tokens per cycle greedy
speculative decoding gets at the drafter's own block size up to the end of each answer, simulated
from every anchor exactly as the engine's cycles run (a test pins that), so no timing noise enters
the table. It reports the
acceptance at the variant's block size, the training time per step and the drafter's size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import dflash2_mlx  # noqa: F401  (the optimised BLAS before mlx.core)

# isort: split

VARIANTS = {
    "base": {},  # the full plan: 2 layers, block 8
    "layers1": {"drafter_layers": 1},
    "layers3": {"drafter_layers": 3, "max_drafter_bytes": 64_000_000},  # 54 MB: measured, never shipped
    "block4": {"drafter_block_size": 4},
}


def heldout_sequences(build, path: Path):
    """The held-out prompts' greedy answers, each generated alone as the engine writes it (a batch
    would pad the shorter prompts, and unmasked padding changes what SmolLM2 answers), in windows
    of the plan's shape: the prompt's last ``context_len`` tokens (left-padded when shorter, as
    the build's windows are), then ``continuation_len`` answer tokens."""
    import numpy as np

    from dflash2_mlx.training.smollm2_generation import generate_batch, left_pad, pad_token_id
    from dflash2_mlx.training.smollm2_prompts import read_prompt_set

    if path.exists():
        with np.load(path) as data:
            return np.asarray(data["sequences"])
    plan, tok = build.plan, build.target.tokenizer
    pad = pad_token_id(tok)
    windows = []
    for record in read_prompt_set(build.work / "prompts.jsonl", "heldout"):
        prompt = np.array([tok.encode(record["prompt"], add_special_tokens=False)], dtype=np.int32)
        answer = generate_batch(build.target.runner, prompt, plan.continuation_len, None, seed=plan.seed)
        context = left_pad([prompt[0, -plan.context_len :]], pad, min_len=plan.context_len)
        windows.append(np.concatenate([context, answer], axis=1))
    sequences = np.concatenate(windows, axis=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, sequences=sequences)
    return sequences


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="a SmolLM2 build's work directory")
    ap.add_argument("--steps", type=int, default=700, help="training steps of every variant")
    ap.add_argument("--variants", default="base,layers1,block4", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reference", type=Path, help="also score this drafter (the shipped one) so")
    args = ap.parse_args(argv)

    from dflash2_mlx.models.loading import load_drafter
    from dflash2_mlx.training.build_smollm2_drafter import Build
    from dflash2_mlx.training.demo_plan import fix_threads
    from dflash2_mlx.training.drafter_batches import answer_ends
    from dflash2_mlx.training.drafter_eval import evaluate_drafter
    from dflash2_mlx.training.smollm2_plan import FULL
    from dflash2_mlx.training.smollm2_stages import drafter_bytes, load_features, train

    fix_threads()
    build = Build(FULL, args.work, args.work / "unused-out")
    records = build.run("features")
    sequences = build.sequences(records["greedy"], records["sampled"])
    kept = load_features(FULL, build.target, sequences, args.work / "features", records["features"].outputs["chunks"])
    vocab = build.trained_vocab()
    held = heldout_sequences(build, args.work / "ablation" / "heldout_answers.npz")
    held_ends = answer_ends(held, FULL.context_len, FULL.drafter_options["answer_end_token_ids"])

    def scored(name: str, drafter_dir: Path) -> dict:
        """The drafter's shape, size and held-out acceptance: the row every variant shares."""
        drafter = load_drafter(str(drafter_dir))
        metrics = evaluate_drafter(build.target, drafter, held, continuation_start=FULL.context_len, ends=held_ends)
        return {
            "variant": name,
            "layers": drafter.config.num_hidden_layers,
            "block_size": drafter.config.block_size,
            "drafter_mb": round(drafter_bytes(drafter_dir) / 1e6, 1),
            "heldout_acceptance": round(metrics["acceptance"], 4),
            "heldout_tau": round(metrics["tau"], 4),
            "heldout_cycles": metrics["cycles"],
        }

    rows = []
    for name in args.variants.split(","):
        plan = dataclasses.replace(FULL, name=f"ablation-{name}", drafter_steps=args.steps, **VARIANTS[name])
        out = args.work / "ablation" / name
        t0 = time.perf_counter()
        trained = train(plan, build.target, sequences, out, build.log, features=kept, draft_vocab=vocab)
        seconds = time.perf_counter() - t0
        state = json.loads((out / "training_state" / "state.json").read_text())
        rows.append(
            scored(name, out)
            | {
                "steps": trained["steps"],
                "seconds_per_step": round(state["elapsed"] / max(trained["steps"], 1), 3),
                "seconds_this_run": round(seconds, 1),
                "final_train_loss": state["history"][-1]["loss"] if state["history"] else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    if args.reference:
        reference = scored(f"reference: {args.reference.name}", args.reference)
        rows.append(reference | {"steps": None, "seconds_per_step": None})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| variant | layers | block | steps | s / step | MB | held-out acceptance (greedy, own block) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['layers']} | {r['block_size']} | {r['steps']} | {r['seconds_per_step']} | "
            f"{r['drafter_mb']} | {r['heldout_acceptance']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
