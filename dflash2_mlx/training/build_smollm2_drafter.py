"""``python -m dflash2_mlx.training.build_smollm2_drafter``: the SmolLM2 drafter's staged build,
whose code is ``training/smollm2/`` (``smollm2/build.py``: the command line, the stage order,
MANIFEST; docs/smollm2.md)."""

from __future__ import annotations

import sys

from dflash2_mlx.training.smollm2.build import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
