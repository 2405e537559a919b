"""Find, load and validate a target and its drafter.

Every failure a user can cause (a wrong path, an unknown repo, a drafter for another target, a
corrupt weight file) raises ``LoadError`` with one line that says what is wrong and what to do.
"""

from __future__ import annotations

import gc
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash2_mlx.caches.target import rollback_setting
from dflash2_mlx.models.drafter import DRAFT_VOCAB_KEY, Drafter
from dflash2_mlx.models.drafter_config import ARCHITECTURES as DRAFTER_ARCHITECTURES
from dflash2_mlx.models.drafter_config import ConfigError, DrafterConfig
from dflash2_mlx.models.drafter_precision import ActivationChoice, apply_activations, choose_activations
from dflash2_mlx.models.target import TargetRunner, UnsupportedModel

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class LoadError(RuntimeError):
    """A model that cannot be loaded, with a one-line reason and what to do."""


def resolve(path_or_repo: str, what: str = "model") -> Path:
    """A local directory, or a Hugging Face repo id downloaded (or found in the cache). For a
    model, a GGUF file (or a directory holding one, or a named local model such as ``smollm2``)
    resolves to its converted mlx-lm directory (see ``models.gguf``)."""
    if what == "model":
        converted = _converted_gguf(path_or_repo)
        if converted is not None:
            return converted
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoadError(f"{what} path {path} is a file; give the directory that holds config.json")
        if not (path / "config.json").exists():
            raise LoadError(
                f"{what} directory {path} has no config.json; give the model's own directory (the one that holds "
                f"config.json and the weights)"
            )
        return path
    if not _REPO_ID.match(path_or_repo) or path_or_repo.startswith((".", "/", "~")):
        raise LoadError(f"{what} path {path_or_repo} does not exist; give a model directory or a repo id like org/name")
    return _download(path_or_repo, what)


def _converted_gguf(spec: str) -> Optional[Path]:
    from dflash2_mlx.models import gguf, named

    try:
        gguf_file = gguf.find_gguf(spec)
        if gguf_file is None:
            return None
        sha256 = gguf.file_sha256(gguf_file)
        named.check_sha256(spec, sha256, gguf_file)
        model_dir = gguf.converted(gguf_file, sha256)
        named.write_generation_config(spec, model_dir)
        return model_dir
    except (gguf.GGUFError, named.NamedModelMissing, gguf.gguf_tokenizer.TokenizerError) as e:
        raise LoadError(str(e)) from None


def _download(repo_id: str, what: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        path = Path(
            snapshot_download(
                repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken"]
            )
        )
    except GatedRepoError:
        raise LoadError(
            f"{what} repo {repo_id} is gated: accept its license on huggingface.co and run `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise LoadError(
            f"{what} repo {repo_id} was not found on Hugging Face (check the name, or log in for a private repo)"
        ) from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            raise LoadError(
                f"{what} repo {repo_id} is not in the local cache and offline mode is on (HF_HUB_OFFLINE); unset "
                f"HF_HUB_OFFLINE to download it, or pass a local directory"
            ) from None
        raise LoadError(
            f"{what} repo {repo_id} is not in the local cache and the Hub cannot be reached; connect once or pass a "
            f"local directory"
        ) from None
    except Exception as e:  # network errors come in many types; all are the user's to retry
        raise LoadError(
            f"could not download {what} repo {repo_id}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    if not (path / "config.json").exists():
        raise LoadError(f"{what} repo {repo_id} has no config.json; is it a model repo?")
    return path


def _one_line(text: str, limit: int = 240) -> str:
    """A multi-line library message (e.g. mlx-lm's list of missing tensors) as one short line."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"cannot read {path}: {e}; the file is damaged, re-download it") from None


def _load_safetensors(files: list[Path]) -> dict[str, mx.array]:
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise LoadError(
                f"weight file {f} is corrupt or truncated ({str(e).splitlines()[0]}); re-download it"
            ) from None
    return weights


@dataclass
class Target:
    runner: TargetRunner
    tokenizer: Any
    config: dict
    name: str
    path: Path


def load_target(path_or_repo: str) -> Target:
    """An mlx-lm model (bf16 or quantized, MLX or original HF layout) wrapped in a TargetRunner."""
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        rollback_setting()  # a bad DFLASH2_MLX_ROLLBACK is the user's to fix, before any work
    except ValueError as e:
        raise LoadError(str(e)) from None
    path = resolve(path_or_repo, "model")
    config = _read_json(path / "config.json")
    if "dflash_config" in config or set(config.get("architectures") or ()) & set(DRAFTER_ARCHITECTURES):
        raise LoadError(f"{path} is a DFlash drafter, not a target model; pass it as --draft-model")
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise LoadError(
            f"model directory {path} has no model*.safetensors weight files; re-download the model or give the "
            f"directory that holds its weights"
        )
    # Read the headers first (lazy, no tensor data): a damaged file is named as such here, not
    # reported by mlx-lm as a config mismatch (a non-UTF-8 header raises a ValueError there).
    _load_safetensors(files)
    try:
        model, config = load_model(path)
    except (ValueError, KeyError) as e:
        msg = _one_line(str(e)) or type(e).__name__
        if "model type" in msg.lower() or "not supported" in msg.lower():
            raise LoadError(f"model {path}: {msg}") from None
        raise LoadError(
            f"model {path} does not match its config.json ({msg}); re-download it, the download may be incomplete"
        ) from None
    except RuntimeError as e:
        raise LoadError(
            f"model {path}: a weight file is corrupt or truncated ({str(e).splitlines()[0]}); re-download it"
        ) from None
    if "gguf" in config:
        from dflash2_mlx.models import gguf

        model = gguf.place_weights(model)  # float32 on the CPU, quantized on Metal
    try:
        runner = TargetRunner(model)
    except UnsupportedModel as e:
        raise LoadError(f"model {path}: {e}") from None
    text_cfg = config.get("text_config", config)
    eos = config.get("eos_token_id", text_cfg.get("eos_token_id"))
    tokenizer = load_tokenizer(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    name = path_or_repo if not Path(path_or_repo).expanduser().exists() else path.name
    if "gguf" in config and Path(path_or_repo).expanduser().exists():
        name = Path(config["gguf"]["file"]).stem  # not the cache directory's hash
    return Target(runner, tokenizer, config, name, path)


def load_drafter(path_or_repo: str, activations: Optional[ActivationChoice] = None) -> Drafter:
    """A DFlash / DFlash 2 drafter checkpoint (dispatched on ``architectures``, not model_type),
    computing in ``activations`` (default: what ``drafter_precision.choose_activations`` picks
    for this machine: float32 on M1/M2 GPUs or when forced, else the stored dtype)."""
    try:
        activations = activations or choose_activations()
    except ValueError as e:  # a bad DFLASH2_MLX_DRAFTER_ACTIVATIONS, before any download
        raise LoadError(str(e)) from None
    path = resolve(path_or_repo, "draft model")
    raw = _read_json(path / "config.json")
    try:
        config = DrafterConfig.from_dict(raw)
    except ConfigError as e:
        archs = raw.get("architectures") or []
        if not set(archs) & set(DRAFTER_ARCHITECTURES):
            raise LoadError(
                f"draft model {path} is not a DFlash drafter (architectures {archs}); pass a DFlash or "
                "DFlash 2 drafter directory as --draft-model (a target model goes in --model)"
            ) from None
        raise LoadError(f"draft model {path}: {e}; check or re-download the drafter's config.json") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(
            f"draft model directory {path} has no .safetensors weight files; re-download the drafter or give the "
            f"directory that holds its weights"
        )
    weights = _load_safetensors(files)
    draft_vocab = _draft_vocab(path, config, weights.pop(DRAFT_VOCAB_KEY, None))
    drafter = Drafter(config)
    quant = raw.get("quantization")
    if quant:
        nn.quantize(
            drafter,
            group_size=quant["group_size"],
            bits=quant["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    expected = dict(tree_flatten(drafter.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise LoadError(
            f"draft model {path} does not match its config.json ({detail}); re-download it: the weights are not a "
            f"complete {config.architecture} checkpoint for this config"
        )
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise LoadError(
                f"draft model {path}: {name} has shape {tuple(value.shape)} but the config implies "
                f"{tuple(expected[name].shape)}; the config.json and weights disagree, re-download the drafter"
            )
    drafter.load_weights(list(weights.items()))
    drafter.eval()
    mx.eval(drafter.parameters())
    apply_activations(drafter, activations)
    drafter.set_draft_vocab(draft_vocab)
    drafter.path = path
    return drafter


def _draft_vocab(path: Path, config: DrafterConfig, ids: Optional[mx.array]) -> Optional[mx.array]:
    """The checkpoint's draft vocabulary (``draft_vocab``, its config's ``draft_vocab_size`` ids),
    checked: sorted, distinct token ids inside the vocabulary."""
    size = config.draft_vocab_size
    if ids is None and not size:
        return None
    fix = "the drafter's draft_vocab and config.json disagree; re-download the drafter or rewrite its draft vocabulary"
    if ids is None or not size:
        have = "no draft_vocab tensor" if ids is None else "a draft_vocab tensor"
        raise LoadError(f"draft model {path}: its weights hold {have} but draft_vocab_size is {size}; {fix}")
    if ids.ndim != 1 or ids.shape[0] != size or not mx.issubdtype(ids.dtype, mx.integer):
        raise LoadError(
            f"draft model {path}: draft_vocab has shape {tuple(ids.shape)} and dtype {ids.dtype}, expected "
            f"({size},) integers; {fix}"
        )
    ids = ids.astype(mx.int32)
    increasing = size == 1 or bool(mx.all(ids[1:] > ids[:-1]).item())
    if not increasing or int(ids[0].item()) < 0 or int(ids[-1].item()) >= config.vocab_size:
        raise LoadError(
            f"draft model {path}: draft_vocab must hold distinct token ids in increasing order inside the "
            f"vocabulary (0..{config.vocab_size - 1}); {fix}"
        )
    return ids


def validate_pair(runner: TargetRunner, config: DrafterConfig, target_name: Optional[str] = None) -> None:
    """Refuse a drafter built for another target, before any work is done."""
    if config.hidden_size != runner.hidden_size:
        raise LoadError(
            f"drafter hidden size {config.hidden_size} does not match the target's {runner.hidden_size}: "
            "this drafter was trained for another target; use the drafter made for this target"
        )
    if runner.vocab_size and config.vocab_size != runner.vocab_size:
        raise LoadError(
            f"drafter vocabulary {config.vocab_size} does not match the target's {runner.vocab_size}: "
            "this drafter was trained for another target; use the drafter made for this target"
        )
    bad = [i for i in config.target_layer_ids if not 0 <= i < runner.num_layers]
    if bad:
        raise LoadError(
            f"drafter taps target layers {config.target_layer_ids} but the target has {runner.num_layers} "
            "layers: this drafter was trained for another target; use the drafter made for this target"
        )
    if config.num_target_layers is not None and config.num_target_layers != runner.num_layers:
        raise LoadError(
            f"drafter expects a target with {config.num_target_layers} layers but this one has "
            f"{runner.num_layers}: this drafter was trained for another target; use the drafter made for this target"
        )
    vocab = runner.vocab_size or config.vocab_size
    if not 0 <= config.mask_token_id < vocab:
        raise LoadError(f"drafter mask token {config.mask_token_id} is outside the vocabulary (size {vocab})")
    if target_name and config.target_name:
        want = config.target_name.rstrip("/").split("/")[-1].lower()
        have = target_name.rstrip("/").split("/")[-1].lower()
        if not (have.startswith(want) or want.startswith(have.split("-mlx")[0])):
            import warnings

            warnings.warn(
                f"drafter was trained for {config.target_name} but the target is {target_name}; acceptance may be low"
            )


def load_pair(
    target_spec: str, drafter_spec: Optional[str], context: Optional[int] = None, label: Optional[str] = None
) -> tuple[Target, Optional[Drafter]]:
    """Load a target (and its drafter) the way the commands and the server do: the memory
    pre-flight first (before any download: a pair that cannot fit ends in one line), then load
    and validate, run the Metal kernels' self-checks for every float dtype the models use (before
    any compile trace) and set the GPU wired limit as mlx-lm does."""
    from dflash2_mlx.kernels import dispatch as kernels
    from dflash2_mlx.models import memory

    try:
        memory.preflight(target_spec, drafter_spec, context, label)
    except (memory.DoesNotFit, ValueError) as e:
        raise LoadError(str(e)) from None
    target = load_target(target_spec)
    drafter = None
    if drafter_spec is not None:
        drafter = load_drafter(drafter_spec)
        validate_pair(target.runner, drafter.config, target.name)
    models = [target.runner.model] + ([drafter] if drafter is not None else [])
    kernels.prepare(kernels.float_dtypes([m.parameters() for m in models]))
    memory.set_wired_limit(sum(memory.tree_bytes(m) for m in models))
    return target, drafter


def freeze_loaded_objects() -> None:
    """Move everything loaded so far (models, tokenizer, libraries: ~200K objects) out of the
    cyclic garbage collector's reach. They live for the whole run, and a full collection that
    walks them stalls decoding for ~0.1 s (measured on the embedded pair: 5% of decode time).
    For applications (the CLI, the server, benchmarks) to call once their models are loaded."""
    gc.collect()
    gc.freeze()
