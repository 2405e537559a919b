"""Which BLAS MLX's CPU matmuls run on (dflash2_mlx/blas.py), checked in fresh interpreters.

The choice is made once, when `dflash2_mlx` is imported before `mlx.core`, so every case runs in
its own process with DFLASH2_MLX_BLAS set.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# Which library defines the process's global `cblas_sgemm`: the one libmlx.so's calls bind to.
PROBE = """
import ctypes, json, sys
import dflash2_mlx
from dflash2_mlx.backend import blas
import mlx.core as mx
mx.eval(mx.ones((8, 64)) @ mx.ones((64, 32)))
sys.stdout.flush()
print("\\nPROBE " + json.dumps({"loaded": blas.loaded, "path": blas.library_path, "status": blas.status,
    "sgemm_from": blas.defining_file(ctypes.CDLL(None), "cblas_sgemm")}))
"""


def system_openblas_present() -> bool:
    from dflash2_mlx.backend.blas import CANDIDATES

    for name in CANDIDATES:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


linux_x86_64 = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
    reason="the mkl wheel, a dependency on Linux x86-64 only",
)


def probe(blas: str, **env):
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DFLASH2_MLX_BLAS": blas, **env},
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :]), out.stdout


@linux_x86_64
def test_mkl_from_its_wheel_takes_over_mlx_matmuls_single_threaded():
    result, stdout = probe("mkl", MKL_VERBOSE="1")
    assert result["loaded"] == "mkl"
    path = Path(result["path"])
    assert path.is_file() and path.name.startswith("libmkl_rt.so")
    assert str(path) in result["status"]  # what `doctor` prints
    assert result["sgemm_from"] == str(path)
    # MKL_VERBOSE logs each call MLX makes into MKL, and the threading layer in use
    assert "SGEMM(" in stdout
    assert "sequential" in stdout


@pytest.mark.skipif(not system_openblas_present(), reason="no system OpenBLAS on this machine")
def test_system_openblas_comes_first_when_installed():
    result, _ = probe("")
    assert result["loaded"] == "openblas"
    assert Path(result["path"]).is_file() and "openblas" in Path(result["path"]).name
    assert result["sgemm_from"] == result["path"]


def test_reference_blas_when_chosen_leaves_mlx_its_own():
    result, _ = probe("reference")
    assert result["loaded"] is None and result["path"] is None
    assert "reference BLAS" in result["status"]


def test_an_unknown_blas_choice_is_named_in_the_status():
    result, _ = probe("atlas")
    assert result["loaded"] is None
    assert "DFLASH2_MLX_BLAS='atlas'" in result["status"] and "openblas, mkl, reference" in result["status"]


def generate(checkpoints, blas: str):
    target, drafter = checkpoints
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash2_mlx",
            "generate",
            "--model",
            str(target),
            "--draft-model",
            str(drafter),
            "--prompt",
            "def f(x):",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DFLASH2_MLX_BLAS": blas},
    )


def test_decoding_on_the_reference_blas_says_so_once_with_the_cost_and_the_fix(tiny_checkpoints):
    out = generate(tiny_checkpoints, "reference")
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if "reference BLAS" in line]
    assert len(notes) == 1
    assert "costs about B plain steps" in notes[0] and "fix: pip install mkl" in notes[0]
    assert out.stderr.splitlines()[0] == notes[0]  # at start, before any output of the run


@pytest.mark.skipif(
    sys.platform.startswith("linux") and platform.machine() != "x86_64" and not system_openblas_present(),
    reason="no optimised BLAS for this CPU here (no mkl wheel, no system OpenBLAS)",
)
def test_decoding_on_an_optimised_blas_prints_no_note(tiny_checkpoints):
    out = generate(tiny_checkpoints, "")
    assert out.returncode == 0, out.stderr
    assert "reference BLAS" not in out.stderr
