import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# No test writes to the user's prompt cache (~/.cache/dflash2-mlx): commands and servers started by
# tests inherit this; tests of the prompt cache pass --prompt-cache-dir with a temporary directory.
os.environ["DFLASH2_PROMPT_CACHE_DIR"] = "none"
# Every command run without --model by a test (in this process, or a command or server it starts)
# runs the embedded tiny pair, as the tests are written for, even where the shipped SmolLM2 drafter
# makes SmolLM2 the default (cli/common.default_model; the tests of that default unset it:
# tests/test_default_pair.py). Tests that name smollm2 read it from the model cache, where CI
# fetches it ahead (`dflash2-mlx download smollm2`), or fetch it there on first use; the tests of
# the fetch use a temporary cache and a local package index (tests/test_model_fetch.py).
os.environ["DFLASH2_MLX_MODEL"] = "tiny"
# GGUF targets (--model smollm2, *.gguf) are converted into a temporary cache, not ~/.cache/dflash2-mlx.
# Removed at exit: a converted SmolLM2 takes ~100 MB.
os.environ["DFLASH2_MLX_GGUF_CACHE"] = tempfile.mkdtemp(prefix="dflash2-gguf-cache-")
atexit.register(shutil.rmtree, os.environ["DFLASH2_MLX_GGUF_CACHE"], ignore_errors=True)

# First, before mlx.core: importing the package loads the optimised BLAS (dflash2_mlx/backend/blas.py),
# as a user's program gets it; loaded after mlx.core it has no effect and every in-process test runs
# on MLX's reference BLAS. The split keeps import sorting from moving it below mlx.core.
import dflash2_mlx  # noqa: F401

# isort: split
import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

# Whole files left out of the everyday run (single slow tests elsewhere carry @pytest.mark.slow).
SLOW_FILES = {
    "test_server.py",
    "test_server_clients.py",
    "test_server_concurrency.py",
    "test_server_prompt_cache.py",
    "test_structured_server.py",  # each starts real servers
    "test_blas.py",  # every case is a fresh interpreter
    "test_lossless.py",
    "test_sampling.py",  # hundreds of randomized decodes; statistical tests
    "test_parity_reference.py",
    "test_parity_transformers.py",  # torch
    "test_training_drafter.py",  # training runs
}


def pytest_collection_modifyitems(config, items):
    """Every test not marked ``slow`` (or in SLOW_FILES) is ``fast``: ``python -m pytest -m fast`` is
    the everyday run (in-process tests on tiny models); ``python -m pytest`` runs everything, as CI does."""
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def hybrid_target():
    """A tiny Qwen3.5-architecture hybrid (3 Gated DeltaNet layers, 1 gated attention layer)."""
    cfg = tiny.hybrid_config()
    return cfg, tiny.build_target(cfg, seed=0, scale=3.0)


@pytest.fixture(scope="session")
def plain_target():
    """A tiny plain-attention Qwen3."""
    cfg = tiny.plain_config()
    return cfg, tiny.build_target(cfg, seed=0, scale=3.0)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, hybrid_target):
    """A hybrid target and a DFlash 2 drafter written to disk in the real layouts."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg, model = hybrid_target
    target = tiny.save_target(model, cfg, root / "target")
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8))
    draft = tiny.save_drafter(drafter, root / "drafter")
    return target, draft


@pytest.fixture(autouse=True)
def _reset_random():
    mx.random.seed(0)
    yield


@pytest.fixture(scope="session")
def embedded_pair():
    """(target dir, drafter dir) of the embedded tiny code-completion demo pair, as the commands
    use it by default. Missing assets are an error, not a skip: the package ships them."""
    from dflash2_mlx import assets

    return assets.demo_target_path(), assets.demo_drafter_path()


@pytest.fixture
def run_in_process(capfd, caplog, monkeypatch):
    """run_in_process(*args): ``dflash2-mlx *args`` through the console entry point ``main()`` in
    this process -> a CompletedProcess-like result: the exit code, what reached fds 1 and 2, and on
    stderr also what a fresh interpreter would have printed there but pytest intercepts (Python
    warnings under the interpreter's default filters, log records at WARNING and above)."""
    from dflash2_mlx.cli.app import main

    def run_main(*args):
        capfd.readouterr()  # drop anything written before
        caplog.clear()
        monkeypatch.setattr(sys, "argv", ["dflash2-mlx", *args])
        code = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capfd.readouterr()
        err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
        err += "".join(f"{r.levelname}: {r.getMessage()}\n" for r in caplog.records if r.levelno >= logging.WARNING)
        return subprocess.CompletedProcess(["dflash2-mlx", *args], code, out, err)

    return run_main
