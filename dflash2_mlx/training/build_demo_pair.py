"""``python -m dflash2_mlx.training.build_demo_pair``: the embedded demo pair's build, whose code is
``training/demo_pair/`` (``demo_pair/build.py``: the command line, the stage order, MANIFEST)."""

from __future__ import annotations

import sys

from dflash2_mlx.training.demo_pair.build import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
