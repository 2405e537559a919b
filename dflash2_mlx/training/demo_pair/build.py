"""Rebuild the embedded tiny demo pair from scratch, in one command.

    python -m dflash2_mlx.training.build_demo_pair            # the real build, into dflash2_mlx/assets
    python -m dflash2_mlx.training.build_demo_pair --quick    # a smoke test in a few minutes (into a temp dir)
    python -m dflash2_mlx.training.build_demo_pair --verify   # seconds: assets and stdlib vs MANIFEST.json
    python -m dflash2_mlx.training.build_demo_pair --check    # rebuild in a temp dir, compare sha256s

Steps: corpus (the stdlib's own .py files, deterministic split) -> byte-level BPE tokenizer ->
target (mlx-lm qwen3_5 hybrid, next-token training) -> the target's greedy continuations of
corpus prefixes -> DFlash 2 drafter trained on them -> evaluation on held-out prompts
(acceptance length at temperature 0 with the identical-to-autoregressive check, at temperature
0.7, and a prompt-lookup n-gram baseline; held-out perplexity; repetition rate) -> the assets
directory and ``MANIFEST.json``.

Everything is fixed: seeds, step counts (never a wall-clock budget), thread counts, and the
order of every list. MLX on the CPU is deterministic for a fixed op sequence, so the same
command on the same machine kind reproduces the committed weights bit for bit (``--check``).

This module is the command line and the orchestration (stages in order, a finished target reused
from a kept ``--work``, the assets directory and its manifest, ``--verify`` and ``--check``). The
recipes are in ``plan``, the stages in ``stages``, the measurements in ``training/evaluation.py``
and ``training/metrics.py`` (shared with the SmolLM2 build), the READMEs and the model card in
``cards``. ``python -m dflash2_mlx.training.build_demo_pair`` runs it (an entry module).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from dflash2_mlx.backend import blas as _blas  # OpenBLAS before mlx.core
from dflash2_mlx.backend.files import read_jsonl, sha256_file
from dflash2_mlx.training import corpus as corpus_mod
from dflash2_mlx.training.build_common import Log, fix_threads
from dflash2_mlx.training.demo_pair import tokenizer as tok_mod
from dflash2_mlx.training.demo_pair.cards import drafter_readme, model_card, summary, target_readme
from dflash2_mlx.training.demo_pair.plan import CHECKED_FILES, DRAFTER_DIR, FULL, PREVIOUS, QUICK, TARGET_DIR, BuildPlan
from dflash2_mlx.training.demo_pair.stages import (
    build_corpus,
    build_documents,
    build_drafter,
    build_target,
    build_tokenizer,
)
from dflash2_mlx.training.evaluation import evaluate, evaluate_defaults

__all__ = ["build", "check", "main", "record_defaults", "verify"]


def default_assets_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "assets"


def build(plan: BuildPlan, out: Path, work: Path, target_only: bool = False) -> dict:
    log = Log()
    t_start = time.perf_counter()
    threads = fix_threads()
    import mlx.core as mx

    log(f"build '{plan.name}' -> {out} (work {work}); BLAS: {_blas.status}, {threads}")
    timings = {}
    t = time.perf_counter()
    files, train, held = build_corpus(plan, log)
    tok_dir = work / "tokenizer"
    tok = build_tokenizer(plan, train, tok_dir, log)
    docs, held_docs, doc_stats = build_documents(plan, tok, train, held, log)
    prompts = corpus_mod.prompt_prefixes(held, plan.num_prompts)
    for p in prompts:  # the held-out text that really follows, for the reference repetition rate
        p["reference_ids"] = tok_mod.encode_plain(tok, [p["reference"]])[0]
    timings["data_seconds"] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    target_work = work / TARGET_DIR
    # A kept --work directory reuses a finished target of the same inputs (a failed drafter stage
    # need not retrain it); the result is the same either way, training is deterministic.
    stage_key = {
        "plan": {
            k: getattr(plan, k)
            for k in (
                "seed",
                "vocab_size",
                "target_model",
                "target_steps",
                "target_batch",
                "seq_len",
                "target_lr",
                "target_warmup",
                "heldout_eval_sequences",
                "deduplicate",
                "chat_percent",
                "chat_max_lines",
                "chat_requests",
            )
        },
        "corpus": corpus_mod.manifest(files)["list_sha256"],
        "tokenizer": sha256_file(tok_dir / "tokenizer.json"),
        "documents": hashlib.sha256(
            np.concatenate([np.asarray(d, dtype=np.int32) for d in docs]).tobytes()
        ).hexdigest(),
    }
    stage_file = work / "target_stage.json"
    target_info, target_seconds = None, None
    if stage_file.exists() and (target_work / "model.safetensors").exists():
        record = json.loads(stage_file.read_text())
        if record.get("key") == stage_key and record.get("weights") == sha256_file(target_work / "model.safetensors"):
            target_info = record["info"]
            target_seconds = record.get("seconds")
            log(f"target: reusing the finished target in {target_work}")
    if target_info is None:
        target_info = build_target(plan, tok, docs, held_docs, tok_dir, target_work, log)
        target_seconds = round(time.perf_counter() - t, 1)
        stage_file.write_text(
            json.dumps(
                {
                    "key": stage_key,
                    "info": target_info,
                    "seconds": target_seconds,
                    "weights": sha256_file(target_work / "model.safetensors"),
                },
                default=_json_default,
            )
        )
    else:  # the stage's own time when it ran (a rerun of the build would spend it again)
        timings["target_reused"] = True
    timings["target_seconds"] = target_seconds

    from dflash2_mlx.models.loading import load_target

    target = load_target(str(target_work))
    drafter_info = None
    if not target_only:
        t = time.perf_counter()
        drafter_info = build_drafter(plan, target, docs, work, log)
        timings["drafter_seconds"] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    drafter_work = drafter_info["dir"] if drafter_info else None
    evaluation = evaluate(plan, target_work, drafter_work, prompts, log)
    timings["evaluation_seconds"] = round(time.perf_counter() - t, 1)
    timings["total_seconds"] = round(
        time.perf_counter() - t_start + (target_seconds or 0.0 if timings.get("target_reused") else 0.0), 1
    )

    # Assemble the assets directory.
    out.mkdir(parents=True, exist_ok=True)
    dst_target = out / TARGET_DIR
    if dst_target.exists():
        shutil.rmtree(dst_target)
    shutil.copytree(target_work, dst_target)
    if drafter_work is not None:
        dst_drafter = out / DRAFTER_DIR
        if dst_drafter.exists():
            shutil.rmtree(dst_drafter)
        dst_drafter.mkdir()
        shutil.copyfile(drafter_work / "model.safetensors", dst_drafter / "model.safetensors")
        # The trainer's config, named as the demo drafter it is (loaders ignore the extra keys).
        raw = json.loads((drafter_work / "config.json").read_text())
        named = {
            "name": DRAFTER_DIR,
            "_name_or_path": DRAFTER_DIR,
            **{k: v for k, v in raw.items() if k not in ("name", "_name_or_path")},
        }
        (dst_drafter / "config.json").write_text(json.dumps(named, indent=2) + "\n")
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p["prompt"]}, ensure_ascii=False) + "\n")

    import mlx_lm
    import tokenizers

    manifest = {
        "name": "tiny-code-demo",
        "description": "Tiny code-completion demo pair (Qwen3.5-architecture hybrid target + DFlash 2 drafter) "
        "trained on the Python standard library; for demos and tests, not a useful model.",
        "build": plan.name,
        "command": "python -m dflash2_mlx.training.build_demo_pair"
        + {"quick": " --quick", "previous": " --plan previous"}.get(plan.name, ""),
        "seed": plan.seed,
        "plan": {k: v for k, v in dataclasses.asdict(plan).items()},
        "python_version": sys.version.split()[0],
        "environment": {
            "python": sys.version.split()[0],
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "blas": _blas.status,
            "threads": threads,
        },
        "corpus": corpus_mod.manifest(files),
        "documents": doc_stats,
        "tokenizer": {
            "vocab_size": tok.get_vocab_size(),
            "special_tokens": tok_mod.special_ids(tok),
            "sha256": sha256_file(tok_dir / "tokenizer.json"),
        },
        "target": {k: v for k, v in target_info.items()},
        "drafter": {k: v for k, v in (drafter_info or {}).items() if k != "dir"} or None,
        "prompts": [{"source": p["source"], "chars": len(p["prompt"])} for p in prompts],
        "evaluation": evaluation,
        "timings": timings,
    }
    # What ships must load as shipped (names, extra config keys, tokenizer files).
    from dflash2_mlx.models.loading import load_drafter, validate_pair

    shipped = load_target(str(dst_target))
    if drafter_work is not None:
        validate_pair(shipped.runner, load_drafter(str(out / DRAFTER_DIR)).config, shipped.name)
    t = time.perf_counter()
    evaluation["defaults"] = evaluate_defaults(
        dst_target,
        out / DRAFTER_DIR if drafter_work is not None else None,
        [p["prompt"] for p in prompts],
        plan.seed,
        log,
    )
    timings["defaults_evaluation_seconds"] = round(time.perf_counter() - t, 1)
    (dst_target / "README.md").write_text(target_readme(manifest))
    if drafter_work is not None:
        (out / DRAFTER_DIR / "README.md").write_text(drafter_readme(manifest))
    manifest["files"] = {name: sha256_file(out / name) for name in CHECKED_FILES if (out / name).exists()}
    manifest["files_bytes"] = {
        p.relative_to(out).as_posix(): p.stat().st_size
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts
    }
    manifest["total_bytes"] = sum(manifest["files_bytes"].values())
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, default=_json_default) + "\n")
    log(f"done in {timings['total_seconds']:.0f}s: {summary(manifest)}")
    return manifest


def record_defaults(out: Path) -> dict:
    """Measure the assets in ``out`` at their chat defaults (``evaluate_defaults``) and record the
    result, the shipped generation_config.json's size and the time taken in MANIFEST.json."""
    fix_threads()
    path = out / "MANIFEST.json"
    m = json.loads(path.read_text())
    prompts = [item["prompt"] for _, item in read_jsonl(out / "prompts.jsonl", "prompt set")]
    t = time.perf_counter()
    m["evaluation"]["defaults"] = evaluate_defaults(out / TARGET_DIR, out / DRAFTER_DIR, prompts, m["seed"], Log())
    m["timings"]["defaults_evaluation_seconds"] = round(time.perf_counter() - t, 1)
    (out / TARGET_DIR / "README.md").write_text(target_readme(m))
    for name in (f"{TARGET_DIR}/generation_config.json", f"{TARGET_DIR}/README.md"):
        m["files_bytes"][name] = (out / name).stat().st_size
    m["total_bytes"] = sum(m["files_bytes"].values())
    path.write_text(json.dumps(m, indent=1, default=_json_default) + "\n")
    return m["evaluation"]["defaults"]


def _json_default(x):
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def verify(out: Path) -> list[str]:
    """Problems found comparing the assets and this machine's stdlib with MANIFEST.json (fast)."""
    path = out / "MANIFEST.json"
    if not path.exists():
        return [f"{path} does not exist"]
    m = json.loads(path.read_text())
    problems = []
    for name, digest in m.get("files", {}).items():
        f = out / name
        if not f.exists():
            problems.append(f"{name}: missing")
        elif sha256_file(f) != digest:
            problems.append(f"{name}: sha256 differs from the manifest")
    current = corpus_mod.manifest(corpus_mod.load_corpus())
    problems += [f"corpus: {d}" for d in corpus_mod.compare_manifests(m.get("corpus", {}), current)]
    return problems


def check(plan: BuildPlan, out: Path, work: Optional[Path]) -> int:
    """Rebuild into a temporary directory and compare every checked file's sha256 with the manifest."""
    recorded = json.loads((out / "MANIFEST.json").read_text())
    if recorded.get("build") != plan.name:
        print(
            f"the manifest records a '{recorded.get('build')}' build; run --check with the same mode", file=sys.stderr
        )
        return 2
    corpus_diff = corpus_mod.compare_manifests(recorded["corpus"], corpus_mod.manifest(corpus_mod.load_corpus()))
    if corpus_diff:
        print(
            "warning: this machine's stdlib differs from the recorded corpus, the weights will differ:\n  "
            + "\n  ".join(corpus_diff),
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory(prefix="dflash2-check-") as tmp:
        fresh = Path(tmp) / "assets"
        rebuilt = build(plan, fresh, work or Path(tmp) / "work")
    bad = [name for name, digest in recorded["files"].items() if rebuilt["files"].get(name) != digest]
    for name in recorded["files"]:
        status = "differs" if name in bad else "identical"
        print(f"{status:9s} {name}")
    print(
        "check passed: the rebuild reproduced the recorded files bit for bit"
        if not bad
        else f"check FAILED: {len(bad)} file(s) differ (same machine kind? same Python, mlx, tokenizers?)"
    )
    return 1 if bad else 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflash2_mlx.training.build_demo_pair", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="assets directory to write (default: dflash2_mlx/assets; with --quick: a new temp dir)",
    )
    ap.add_argument("--work", type=Path, default=None, help="keep intermediate files here (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny step counts: a smoke test in a few minutes")
    ap.add_argument(
        "--plan",
        choices=["full", "previous"],
        default="full",
        help="full: the committed pair's recipe; previous: the recipe of the pair before it",
    )
    ap.add_argument("--target-only", action="store_true", help="stop after the target (no drafter)")
    ap.add_argument("--verify", action="store_true", help="compare the assets and the stdlib with MANIFEST.json")
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare sha256s with MANIFEST.json")
    ap.add_argument("--card", action="store_true", help="print the model card (markdown) of the MANIFEST.json in --out")
    ap.add_argument(
        "--evaluate-defaults",
        action="store_true",
        help="measure the pair in --out at its generation_config.json defaults and record it in MANIFEST.json",
    )
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else {"full": FULL, "previous": PREVIOUS}[args.plan]
    out = args.out
    if out is None:
        out = (
            Path(tempfile.mkdtemp(prefix="dflash2-quick-"))
            if (args.quick and not (args.verify or args.check or args.card))
            else default_assets_dir()
        )
    if args.card:
        print(model_card(json.loads((out / "MANIFEST.json").read_text())), end="")
        return 0
    if args.evaluate_defaults:
        record_defaults(out)
        return 0
    if args.verify:
        problems = verify(out)
        for p in problems:
            print(p)
        print("verify passed" if not problems else f"verify found {len(problems)} problem(s)")
        return 1 if problems else 0
    if args.check:
        return check(plan, out, args.work)
    if args.work is not None:
        build(plan, out, args.work, target_only=args.target_only)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash2-build-") as tmp:
            build(plan, out, Path(tmp), target_only=args.target_only)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
