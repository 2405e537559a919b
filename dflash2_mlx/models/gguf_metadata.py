"""Reading a GGUF file's metadata fields (shared by the weight conversion and the tokenizer)."""

from __future__ import annotations


def field(reader, key: str, default=None):
    """A metadata value (string, number or list) of a ``gguf.GGUFReader``, or ``default``."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()
