"""What the staged SmolLM2 drafter build is made of, and how its stages resume.

``SmolPlan`` holds every knob of the build (``FULL`` is the real SmolLM2 build, ``TINY`` a
smoke test that runs every stage in a minute on any small llama-style target). ``StageRecord``
is the marker a finished stage leaves in the work directory: the stage is skipped on the next
run when the marker's key (a sha256 of the plan fields and input files the stage depends on)
still matches. Every file is written to a temporary name and renamed, so a kill leaves either
the old file or the new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dflash2_mlx.backend.files import atomic_write_bytes, atomic_write_text

__all__ = [
    "FULL",
    "PLANS",
    "SESSION",
    "STAGES",
    "TINY",
    "SmolPlan",
    "StageRecord",
    "atomic_write_bytes",
    "atomic_write_text",
    "stage_key",
]

# The build's stages, in order (``--stage`` runs one of them, and the ones before it if needed).
STAGES = ("prompts", "greedy", "sampled", "features", "train", "evaluate")


@dataclass(frozen=True)
class SmolPlan:
    """Every knob of a SmolLM2 drafter build."""

    name: str
    target: str = "smollm2"  # a name, a GGUF file or a model directory (load_target)
    seed: int = 0
    # prompts: how many of each kind reach the training split (after deduplication), and how
    # many of each kind are held out for evaluation
    # (``task``, everyday chat requests, came with issue 40: 12 held out, the other 162 trained)
    train_per_kind: dict = field(
        default_factory=lambda: {"code": 420, "explain": 260, "short": 220, "self": 120, "task": 162}
    )
    heldout_per_kind: dict = field(default_factory=lambda: {"code": 8, "explain": 8, "short": 8, "self": 6, "task": 12})
    corpus_limit: Optional[int] = None  # stdlib files read for coding requests (None: all)
    question_tokens: int = 40  # the target's own questions: at most this many tokens
    # continuations: the target's answers, greedy and sampled, in chunks of one batch each
    context_len: int = 64  # prompt tokens kept before each answer in a training sequence
    continuation_len: int = 128
    batch_size: int = 32
    # features and training use the first `windows` training sequences (None: all): every greedy
    # answer comes first, then the sampled ones. The target's pass over the windows costs about
    # as much as generating them, and a prefix keeps the feature chunks a longer run computed.
    windows: Optional[int] = None
    sample_temperature: float = 0.7
    sample_top_p: float = 0.9
    # drafter: hidden 576 and the vocabulary are the target's (shared embedding and head)
    drafter_layers: int = 2
    drafter_block_size: int = 8
    drafter_taps: tuple = (7, 22)  # of the target's 30 layers, never the last
    # 2000 steps, not the tiny pair's 3000: a step cost about a tenth of a 32 x 128-token
    # generation chunk in the same run (docs/smollm2.md), 1-4 s on a quiet machine, and 3000
    # would overrun the build's 3 hours
    drafter_steps: int = 2000
    # mask_token_id 16 is SmolLM2's "<empty_output>", a special token chat never uses. Selector
    # rank 16: its two codebooks are vocabulary x rank (49152 x 32 x 2 in float32 is 12.6 MB), and
    # rank 32 puts two layers at 45 MB, over the budget; rank 16 gives about 38.7 MB. 8 blocks per
    # sequence: each step's cost is dominated by the LM head over every block row (drafter and
    # target logits for the soft targets), 8 x 8 x 7 rows x 49152.
    drafter_options: dict = field(
        default_factory=lambda: {
            "soft_target_weight": 0.5,
            "mask_token_id": 16,
            "selector_rank": 16,
            "blocks_per_sequence": 8,
            "feature_cache_bytes": 6 << 30,
            "checkpoint_every": 100,
            # <|endoftext|> and <|im_end|>: the answers run on past the end of the turn (about 30%
            # of the continuation tokens); no block is anchored there
            "answer_end_token_ids": [0, 2],
        }
    )
    # the drafter's draft vocabulary (training/drafter/draft_vocab.py): its head scores these many ids,
    # every token of the target's continuations first (SmolLM2's: 6695 distinct), so a draft
    # reads 8192 of the head's 49152 rows (measured: draft 13.1 -> 5.8 ms at block 2). 0: none
    draft_vocab_size: int = 8192
    # train the drafter on that vocabulary (its head and soft targets over those ids only), as it
    # will draft: the LM head over every block row was most of a step (3.4-4.1 -> 1.1-1.2 s a step
    # here, measured side by side); False trains with the whole head and adds the vocabulary after
    train_on_draft_vocab: bool = True
    # evaluation
    eval_max_tokens: int = 128
    max_drafter_bytes: int = 40 << 20

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fields(self, *names: str) -> dict:
        """The named fields, for a stage's key."""
        return {n: _plain(getattr(self, n)) for n in names}


FULL = SmolPlan(name="full")
# What one 3-hour session builds beside its other work (the drafter shipped in the package): every
# window (the features of all 1974 are on disk from an earlier run of the full plan), 700 steps,
# answers of 96 tokens in the evaluation. Training runs ~3-3.5 s a step here, so FULL's 2000 steps
# need a session of their own (docs/smollm2.md). (The first shipped drafter was built with 1280
# windows, 500 steps and anchors past the end of the answers: held-out acceptance 1.37.)
SESSION = dataclasses.replace(FULL, name="session", drafter_steps=700, eval_max_tokens=96, train_on_draft_vocab=False)
# Every stage end to end in about a minute: a handful of prompts and tokens, a few steps. It runs
# the target's question-writing pass but keeps none of its questions: a random tiny target
# writes no question marks.
TINY = dataclasses.replace(
    FULL,
    name="tiny",
    train_per_kind={"code": 6, "explain": 4, "short": 4, "self": 0, "task": 2},
    heldout_per_kind={"code": 1, "explain": 1, "short": 1, "self": 0, "task": 1},
    corpus_limit=40,
    question_tokens=8,
    context_len=16,
    continuation_len=16,
    batch_size=4,
    drafter_layers=1,
    drafter_taps=(0, 1),
    drafter_steps=4,
    draft_vocab_size=64,
    drafter_options={
        "soft_target_weight": 0.5,
        "mask_token_id": 0,
        "checkpoint_every": 2,
        "batch_size": 2,
        "blocks_per_sequence": 2,
    },
    eval_max_tokens=12,
)
PLANS = {"full": FULL, "session": SESSION, "tiny": TINY}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def stage_key(**inputs: Any) -> str:
    """sha256 of a stage's inputs (plan fields, digests of input files), as canonical JSON."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=_plain).encode()).hexdigest()


@dataclass
class StageRecord:
    """The marker of a finished stage: its key, what it produced and how long it took."""

    stage: str
    key: str
    seconds: float
    outputs: dict

    @staticmethod
    def path(work: Path, stage: str) -> Path:
        return Path(work) / "stages" / f"{stage}.json"

    @classmethod
    def load(cls, work: Path, stage: str, key: str) -> Optional["StageRecord"]:
        """The stage's marker if the stage finished with these inputs, else None."""
        path = cls.path(work, stage)
        if not path.exists():
            return None
        try:
            record = cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            return None
        return record if record.key == key else None

    def save(self, work: Path) -> None:
        atomic_write_text(self.path(work, self.stage), json.dumps(dataclasses.asdict(self), indent=1) + "\n")
