"""What a build of the embedded demo pair is made of, and the fixed conditions it runs under.

``BuildPlan`` holds every knob of a build (``FULL`` is the committed pair, ``PREVIOUS`` the
recipe before it, ``QUICK`` a smoke test); beside it the assets' directory names and checked
files and the chat defaults written to the target's generation_config.json (the pinned BLAS
thread count and the build's log are ``training/build_common.py``, shared with the SmolLM2 build).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "BuildPlan",
    "CHAT_DEFAULTS",
    "CHECKED_FILES",
    "DRAFTER_DIR",
    "FULL",
    "PREVIOUS",
    "QUICK",
    "TARGET_DIR",
    "generation_config",
]


TARGET_DIR = "tiny-code-demo-target"
DRAFTER_DIR = "tiny-code-demo-drafter"


@dataclass
class BuildPlan:
    """Every knob of a build. ``FULL`` is the committed pair; ``QUICK`` a smoke test."""

    name: str
    seed: int = 0
    vocab_size: int = 2048
    # target
    target_model: dict = field(
        default_factory=lambda: dict(
            hidden_size=256,
            num_layers=6,
            intermediate_size=448,
            full_attention_interval=3,
            attention_heads=4,
            kv_heads=2,
            head_dim=32,
            linear_key_heads=2,
            linear_value_heads=4,
            linear_head_dim=32,
        )
    )
    target_steps: int = 500
    target_batch: int = 4
    seq_len: int = 512
    target_lr: float = 3e-3
    target_warmup: int = 25
    heldout_eval_sequences: Optional[int] = None  # None: every held-out sequence
    # data: drop verbatim copies of files (and of chat examples); chat examples
    # (corpus.function_examples): share of functions, longest function in lines, plain-English
    # requests made from docstrings beside the signature form
    deduplicate: bool = False
    chat_percent: int = 20
    chat_max_lines: int = 40
    chat_requests: bool = False
    json_percent: int = 0  # share of public functions also described as JSON (corpus.json_examples)
    # drafter data and training
    drafter_sequences: int = 2048
    # more sequences continued by sampling at drafter_sample_temperature (a drafter for sampled
    # decoding sees sampled contexts); soft targets: drafter_options soft_target_weight
    drafter_sampled_sequences: int = 0
    drafter_sample_temperature: float = 0.7
    prefix_len: int = 96
    continuation_len: int = 128
    drafter_steps: int = 1500
    drafter_layers: int = 2
    drafter_block_size: int = 8
    drafter_taps: list = field(default_factory=lambda: [1, 3])
    drafter_options: dict = field(default_factory=dict)  # extra DrafterTrainingConfig fields
    # evaluation
    num_prompts: int = 24
    eval_max_tokens: int = 128
    sample_temperature: float = 0.7


# The committed pair: deduplicated data, 40% of the functions as chat examples (with plain-English
# requests) so answers end their turn, 3 M target tokens (1500 steps: ~1600 tok/s on a quiet
# 2-core machine), and a drafter distilled on the target's whole distribution over greedy and
# sampled continuations (so it drafts for chat temperatures too).
FULL = BuildPlan(
    name="full",
    target_steps=1500,
    target_warmup=50,
    deduplicate=True,
    chat_percent=40,
    chat_max_lines=30,
    chat_requests=True,
    json_percent=20,
    drafter_sequences=2560,
    drafter_sampled_sequences=2560,
    drafter_steps=3000,
    drafter_options={"soft_target_weight": 0.5, "feature_cache_bytes": 6 << 30},
)
# The recipe of the previous committed pair (greedy continuations, labels only, 500 target steps).
PREVIOUS = BuildPlan(name="previous")
QUICK = dataclasses.replace(
    FULL,
    name="quick",
    target_steps=12,
    target_warmup=3,
    heldout_eval_sequences=16,
    drafter_sequences=32,
    drafter_sampled_sequences=32,
    prefix_len=32,
    continuation_len=32,
    drafter_steps=10,
    num_prompts=4,
    eval_max_tokens=32,
)


# What `chat` and the server use for the demo pair when the user sets nothing
# (generation_config.json): sampling, because a tiny target's greedy output loops; a modest cap.
CHAT_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 256}


def generation_config(eos_ids: list[int]) -> dict:
    """The target's generation_config.json: its end tokens and the demo pair's chat defaults."""
    return {"eos_token_id": list(eos_ids), **CHAT_DEFAULTS}


# The files whose sha256 MANIFEST.json records: what --verify and --check compare.
CHECKED_FILES = [
    f"{TARGET_DIR}/model.safetensors",
    f"{TARGET_DIR}/config.json",
    f"{TARGET_DIR}/tokenizer.json",
    f"{TARGET_DIR}/tokenizer_config.json",
    f"{DRAFTER_DIR}/model.safetensors",
    f"{DRAFTER_DIR}/config.json",
    "prompts.jsonl",
]
