"""Small file helpers the package shares: a file's sha256, atomic writes, and JSONL files read line by line."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Union


def sha256_file(path: Union[str, Path]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (weights files do not fit in memory twice)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a kill leaves the old file or the new one whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write_bytes`` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


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
