"""SmolLM2 drafter ablations at an equal budget: depth (1 or 2 layers) and training block size (4 or 8).

    python benchmarks/smollm2_ablation.py --work WORK [--steps 700] [--variants base,layers1,block4]
                                          [--json out.json]

``WORK`` is a SmolLM2 build's work directory (``training/smollm2/build.py``): its prompts,
continuations and features stages are reused (run there first if missing; the continuations are
committed, so only the features pass runs on a fresh machine). Every variant is the full plan's
drafter with one knob changed, trained for ``--steps`` steps on the same data, with the same seed,
on the plan's draft vocabulary, into ``WORK/ablation/<variant>`` (a killed run resumes there).

Each is then scored on the held-out prompts' greedy answers (the target's own, each as the engine
writes it alone, up to 128 tokens or its end token, made once into
``WORK/ablation/heldout_windows.npz``; windows and features as the build's training windows: the
prompt's tail without padding, features from the whole prompt) with ``evaluate_drafter``: the tokens per cycle greedy
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


def heldout_windows(build, path: Path):
    """The held-out prompts' greedy answers, each as the engine writes it alone (answered
    together by ``answer_prompts``, which equals that; stopped at the end token), in windows of
    the build's shape (``smollm2.stages.make_windows``: the prompt's last ``context_len`` tokens,
    no padding, then the answer) -> (windows, their answer ends for ``evaluate_drafter``)."""
    import numpy as np

    from dflash2_mlx.training.smollm2.generation import answer_prompts
    from dflash2_mlx.training.smollm2.prompts import read_prompt_set
    from dflash2_mlx.training.smollm2.stages import Windows, make_windows

    plan, tok = build.plan, build.target.tokenizer
    stops = sorted(tok.eos_token_ids)
    if path.exists():
        with np.load(path) as data:
            windows = Windows.from_arrays(data)
    else:
        prompts = [
            tok.encode(r["prompt"], add_special_tokens=False)
            for r in read_prompt_set(build.work / "prompts.jsonl", "heldout")
        ]
        answers = answer_prompts(build.target.runner, prompts, plan.continuation_len, stop_ids=stops)
        windows = make_windows(prompts, answers, plan.context_len, plan.continuation_len)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **windows.arrays())
    # the end token's position where the answer wrote one, else one past its last token
    ends = np.array(
        [n - 1 if windows.sequences[i, n - 1] in stops else n for i, n in enumerate(windows.lengths.tolist())]
    )
    return windows, ends


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="a SmolLM2 build's work directory")
    ap.add_argument("--steps", type=int, default=700, help="training steps of every variant")
    ap.add_argument("--variants", default="base,layers1,block4", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reference", type=Path, help="also score this drafter (the shipped one) so")
    args = ap.parse_args(argv)

    from dflash2_mlx.models.loading import load_drafter
    from dflash2_mlx.training.build_common import fix_threads
    from dflash2_mlx.training.drafter.evaluation import evaluate_drafter
    from dflash2_mlx.training.drafter.features import TargetFeatures
    from dflash2_mlx.training.smollm2.build import Build
    from dflash2_mlx.training.smollm2.plan import FULL
    from dflash2_mlx.training.smollm2.stages import drafter_bytes, load_features, train, window_features

    fix_threads()
    build = Build(FULL, args.work, args.work / "unused-out")
    records = build.run("features")
    windows = build.sequences(records["greedy"], records["sampled"])
    kept = load_features(FULL, build.target, windows, args.work / "features", records["features"].outputs["chunks"])
    vocab = build.trained_vocab()
    held, held_ends = heldout_windows(build, args.work / "ablation" / "heldout_windows.npz")
    taps = list(FULL.drafter_taps)
    held_features = TargetFeatures.from_arrays(
        build.target.runner, held.sequences, taps, window_features(build.target.runner, held, taps)[0]
    )

    def scored(name: str, drafter_dir: Path) -> dict:
        """The drafter's shape, size and held-out acceptance: the row every variant shares."""
        drafter = load_drafter(str(drafter_dir))
        if list(drafter.config.target_layer_ids) != taps:
            raise ValueError(f"{drafter_dir} taps {drafter.config.target_layer_ids}, not the plan's {taps}")
        metrics = evaluate_drafter(
            build.target, drafter, held.sequences, held.starts, ends=held_ends, features=held_features
        )
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
        trained = train(plan, build.target, windows, out, build.log, features=kept, draft_vocab=vocab)
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
