"""The tiny-scale ablation of DFlash 2's parts: four drafters at an equal training budget.

    python -m dflash2_mlx.training.demo_pair.ablation --steps 800 --json docs/results/ablation.json

Variants, each trained from the same initialisation seed on the same data (the embedded target's
own greedy and sampled continuations, generated exactly as the demo build does, with its soft
targets) for the same number of steps:

    DFlash 1        no convolutions, no selector (independent per-position argmax)
    + selector      the candidate selector, no convolutions
    + convs         the two-tap dynamic convolutions, no selector
    + both          DFlash 2

Each is evaluated through the real engine on the embedded pair's held-out prompts at temperature 0
and the given block size: mean acceptance length, acceptance per block position (the share of
cycles that accepted that draft position) and whether the output equals plain decoding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np  # noqa: E402

from dflash2_mlx.backend import blas as _blas  # noqa: F401  (OpenBLAS before mlx.core)

VARIANTS = (
    ("DFlash 1", dict(convs=False, selector=False)),
    ("+ selector", dict(convs=False, selector=True)),
    ("+ convs", dict(convs=True, selector=False)),
    ("+ both (DFlash 2)", dict(convs=True, selector=True)),
)


def training_data(plan, target, work: Path, log) -> tuple[np.ndarray, list[dict]]:
    """The demo build's drafter data and held-out prompts (cached in ``work``: generation takes minutes)."""
    from dflash2_mlx.backend.files import sha256_file
    from dflash2_mlx.training import corpus as corpus_mod
    from dflash2_mlx.training.demo_pair import stages

    files, train, held = stages.build_corpus(plan, log)
    tok = stages.build_tokenizer(plan, train, work / "tokenizer", log)
    docs, _, _ = stages.build_documents(plan, tok, train, held, log)
    prompts = corpus_mod.prompt_prefixes(held, plan.num_prompts)
    key = hashlib.sha256(
        json.dumps(
            [
                corpus_mod.manifest(files)["list_sha256"],
                sha256_file(work / "tokenizer" / "tokenizer.json"),
                plan.drafter_sequences,
                plan.drafter_sampled_sequences,
                plan.drafter_sample_temperature,
                plan.prefix_len,
                plan.continuation_len,
                plan.seed + 1,
                sha256_file(Path(target.path) / "model.safetensors"),
            ]
        ).encode()
    ).hexdigest()[:16]
    cached = work / f"drafter_data_{key}.npy"
    if cached.exists():
        log(f"drafter data: reusing {cached}")
        return np.load(cached), prompts
    t0 = time.perf_counter()
    seqs = stages.drafter_data(plan, target, docs)
    np.save(cached, seqs)
    log(f"drafter data: {seqs.shape[0]} sequences in {time.perf_counter() - t0:.0f}s")
    return seqs, prompts


def evaluate_variant(
    target,
    drafter_dir: Path,
    prompts: list[dict],
    block_size: int,
    max_tokens: int,
    reference: Optional[list[list[int]]],
) -> tuple[dict, list[list[int]]]:
    """Acceptance (mean and per position) of one drafter on ``prompts`` at temperature 0."""
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.output import collect
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings
    from dflash2_mlx.models.loading import load_drafter

    drafter = load_drafter(str(drafter_dir))
    tok = target.tokenizer
    settings = GenerationSettings(
        max_tokens=max_tokens, block_size=block_size, stop_token_ids=sorted(tok.eos_token_ids)
    )

    if reference is None:
        reference = [
            collect(
                generate_autoregressive(target.runner, tok.encode(p["prompt"], add_special_tokens=False), settings, tok)
            )[0]
            for p in prompts
        ]
    cycle_tokens = cycles = 0
    accepted = [0] * (block_size - 1)
    drafted = [0] * (block_size - 1)
    identical = True
    for p, ref in zip(prompts, reference):
        ids = tok.encode(p["prompt"], add_special_tokens=False)
        out, st = collect(generate_speculative(target.runner, drafter, ids, settings, tok))
        identical &= out == ref
        cycle_tokens += st.cycle_tokens
        cycles += st.verify_steps
        accepted = [a + b for a, b in zip(accepted, st.accepted_by_position)]
        drafted = [a + b for a, b in zip(drafted, st.drafted_by_position)]
    return {
        "acceptance_length": cycle_tokens / cycles,
        "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
        "cycles": cycles,
        "identical_to_autoregressive": identical,
    }, reference


def markdown_table(result: dict) -> str:
    b = result["block_size"]
    head = "| variant | acceptance length | " + " | ".join(f"pos {i}" for i in range(1, b)) + " | final train loss |"
    sep = "|---|---|" + "---|" * (b - 1) + "---|"
    rows = []
    for v in result["variants"]:
        cells = " | ".join(f"{x:.2f}" for x in v["acceptance_by_position"])
        loss = v.get("final_loss")
        rows.append(
            f"| {v['name']} | {v['acceptance_length']:.2f} | {cells} | {'-' if loss is None else f'{loss:.3f}'} |"
        )
    return "\n".join([head, sep, *rows]) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflash2_mlx.training.demo_pair.ablation", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--steps", type=int, default=800, help="training steps per variant (the equal budget)")
    ap.add_argument("--work", type=Path, default=None, help="keep the data and the four drafters here")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (default: the build's)")
    args = ap.parse_args(argv)

    from dflash2_mlx.assets import demo_target_path
    from dflash2_mlx.models.loading import load_target
    from dflash2_mlx.training.build_common import Log, fix_threads
    from dflash2_mlx.training.demo_pair import plan as demo_plan
    from dflash2_mlx.training.drafter.config import DrafterTrainingConfig
    from dflash2_mlx.training.drafter.trainer import train_drafter

    plan = demo_plan.FULL
    log = Log()
    fix_threads()
    work = args.work or Path(tempfile.mkdtemp(prefix="dflash2-ablation-"))
    work.mkdir(parents=True, exist_ok=True)
    target = load_target(str(demo_target_path()))
    seqs, prompts = training_data(plan, target, work, log)
    max_tokens = args.max_tokens or plan.eval_max_tokens
    result = {
        "steps": args.steps,
        "block_size": plan.drafter_block_size,
        "layers": plan.drafter_layers,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "command": "python -m dflash2_mlx.training.demo_pair.ablation "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "variants": [],
    }
    reference = None
    for name, flags in VARIANTS:
        cfg = DrafterTrainingConfig(
            block_size=plan.drafter_block_size,
            layers=plan.drafter_layers,
            steps=args.steps,
            seed=plan.seed,
            target_layer_ids=list(plan.drafter_taps),
            **flags,
            **plan.drafter_options,
        )
        out = work / name.split(" (")[0].replace("+ ", "plus-").replace(" ", "-").lower()
        t0 = time.perf_counter()
        train_drafter(  # resumes (or returns at once) when --work already holds this variant's run
            target, seqs, out, cfg, continuation_start=plan.prefix_len, progress=sys.stderr.isatty()
        )
        seconds = time.perf_counter() - t0
        row, reference = evaluate_variant(target, out, prompts, plan.drafter_block_size, max_tokens, reference)
        state_file = out / "training_state" / "state.json"
        history = json.loads(state_file.read_text()).get("history", []) if state_file.exists() else []
        row.update(
            name=name, **flags, train_seconds=round(seconds, 1), final_loss=history[-1].get("loss") if history else None
        )
        result["variants"].append(row)
        log(
            f"{name}: acceptance {row['acceptance_length']:.2f}, per position "
            f"{[round(x, 2) for x in row['acceptance_by_position']]}, identical {row['identical_to_autoregressive']}"
        )
    print(markdown_table(result), end="")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
