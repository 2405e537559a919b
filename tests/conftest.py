import os
import sys
from pathlib import Path

# No test writes to the user's prompt cache (~/.cache/dflash2-mlx): commands and servers started by
# tests inherit this; tests of the prompt cache pass --prompt-cache-dir with a temporary directory.
os.environ["DFLASH2_PROMPT_CACHE_DIR"] = "none"

# First, before mlx.core: importing the package loads the optimised BLAS (dflash2_mlx/backend/blas.py),
# as a user's program gets it; loaded after mlx.core it has no effect and every in-process test runs
# on MLX's reference BLAS. The split keeps import sorting from moving it below mlx.core.
import dflash2_mlx  # noqa: F401

# isort: split
import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402


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
