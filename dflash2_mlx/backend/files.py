"""Small file helpers the package shares: a file's sha256, and JSONL files read line by line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Union


def sha256_file(path: Union[str, Path]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (weights files do not fit in memory twice)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class JsonlError(ValueError):
    """A JSONL file that cannot be read, or a line of it that is not JSON (the message names it)."""


def read_jsonl(path: Union[str, Path], what: str = "file") -> list[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line of a UTF-8 JSONL file.

    ``what`` names the file in errors ("prompt file", "data file"); every error is a ``JsonlError``
    with a one-line message: the file is missing or unreadable, or ``path:N`` is not JSON.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JsonlError(f"{what} {path} does not exist") from None
    except UnicodeDecodeError:
        raise JsonlError(f"{what} {path} is not UTF-8 text") from None
    except OSError as e:
        raise JsonlError(f"cannot read {what} {path}: {e.strerror or e}") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise JsonlError(f"{path}:{number}: not valid JSON ({e.msg})") from None
    return records
