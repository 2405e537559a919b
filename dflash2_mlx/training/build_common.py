"""What both model builds (the demo pair's, ``demo_pair/``; SmolLM2's drafter, ``smollm2/``) run
under: the pinned BLAS thread count and the build's timestamped log."""

from __future__ import annotations

import sys
import time

from dflash2_mlx.backend import blas as _blas  # OpenBLAS before mlx.core

__all__ = ["THREADS", "Log", "fix_threads"]

THREADS = 2


def fix_threads(n: int = THREADS) -> str:
    """Pin the BLAS to the build's thread count; says what runs (recorded in MANIFEST)."""
    return _blas.set_threads(n)


class Log:
    """The build's log: each message on stderr with the seconds since the log was made."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)
