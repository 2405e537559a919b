"""An untrained stand-in for the SmolLM2 drafter: the build plan's drafter as the trainer starts it.

    python benchmarks/smollm2_standin_drafter.py /tmp/smol_standin_drafter   # SmolLM2 fetched on first use

Same shapes, taps (7, 22), block size (8) and mask token (16) as the trained drafter the build
writes to its ``--out`` directory, so the SmolLM2 checks (``smollm2_lossless.py``,
``smollm2_distribution.py``, ``smollm2_clients.py``) can be developed and run before it exists.
Its drafts are almost never accepted: it exercises the rejection paths, not the speed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import dflash2_mlx  # noqa: F401  (loads the BLAS before mlx.core)
from dflash2_mlx.models.loading import load_target
from dflash2_mlx.training.smollm2.plan import PLANS
from dflash2_mlx.training.smollm2.stages import save_untrained_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the drafter directory to write (config.json + model.safetensors)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="full")
    parser.add_argument("--model", default="smollm2", help="the target (default: smollm2)")
    args = parser.parse_args()
    out = save_untrained_drafter(PLANS[args.plan], load_target(args.model), args.out)
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
