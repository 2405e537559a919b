"""The model's own generation defaults (``generation_config.json``), read once for ``chat`` and the server.

Thinking models are meant to be used sampled, so their sampling settings and answer length come
from the file the model ships. Values the engine would refuse (``SamplingSettings``) are dropped
with a warning rather than passed on: a bad file must not make every chat turn or every server
request fail for a setting the user never gave.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Union

log = logging.getLogger("dflash2_mlx")

FILE_NAME = "generation_config.json"

# The range SamplingSettings accepts for each sampling key.
_VALID = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= 0 and float(v).is_integer(),
    "min_p": lambda v: 0 <= v < 1,
}


def generation_defaults(model_dir: Union[str, Path]) -> dict:
    """Defaults from ``model_dir/generation_config.json``, each key present only when the file sets it
    validly: ``max_new_tokens`` (positive int) and the sampling keys ``temperature``, ``top_p``,
    ``top_k`` (int) and ``min_p``. ``do_sample: false`` means greedy (``temperature`` 0, the other
    sampling keys ignored). A missing or unreadable file, or one that is not a JSON object, gives {}.
    """
    path = Path(model_dir) / FILE_NAME
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        log.warning("%s is not a JSON object; its defaults are ignored", path)
        return {}
    out: dict = {}
    limit = cfg.get("max_new_tokens")
    if _is_number(limit) and isinstance(limit, int) and limit > 0:
        out["max_new_tokens"] = limit
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
        return out
    for key, valid in _VALID.items():
        value = cfg.get(key)
        if value is None:
            continue
        if not _is_number(value) or not valid(value):
            log.warning("%s: %s=%r is outside what the sampler accepts; ignored", path, key, value)
            continue
        out[key] = int(value) if key == "top_k" else value
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
