"""What the benchmarks share: the pair to measure (by default the embedded demo pair) and the report.

Each benchmark still imports ``dflash2_mlx`` before ``mlx.core`` itself (that loads OpenBLAS first,
see ``dflash2_mlx.backend.blas``); this module is imported from the benchmark's own folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def load_pair(model: Optional[str] = None, draft_model: Optional[str] = None):
    """(Target, Drafter) to measure: the given ones, else the embedded demo pair's. The loaded
    objects are frozen out of the garbage collector, as the CLI does, so that a full collection does
    not stall whatever is being timed."""
    from dflash2_mlx import assets
    from dflash2_mlx.models.loading import freeze_loaded_objects, load_drafter, load_target

    target = load_target(model or str(assets.demo_target_path()))
    drafter = load_drafter(draft_model or str(assets.demo_drafter_path()))
    freeze_loaded_objects()
    return target, drafter


def write_report(report: dict, json_path: Optional[Path]) -> None:
    """The report as JSON on stdout, and in ``json_path`` too when given (``--json``)."""
    text = json.dumps(report, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
