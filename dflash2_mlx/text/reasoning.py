"""The model's reasoning block, as its own tokenizer marks it: used by ``chat`` and the server alike.

mlx-lm's ``TokenizerWrapper`` infers the markers from the vocabulary (``<think>``/``</think>``,
``<longcat_think>``, multi-token ones...). A tokenizer without them has no reasoning block: its
output is all answer, whatever text it writes.
"""

from __future__ import annotations

from typing import Optional, Sequence


def reasoning_tags(tokenizer) -> Optional[tuple[str, str]]:
    """(start, end) text of the tokenizer's reasoning markers, or None when the model has none."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start, tokenizer.think_end
    return (start, end) if start and end else None


def initial_state(tokenizer, prompt: Sequence[int]) -> str:
    """ "reasoning" when ``prompt`` leaves a reasoning block open (the chat template's generation
    prompt opened it), else "normal"; a state the tokenizer names for responses wins."""
    opened = getattr(tokenizer, "has_thinking", False) and (
        tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
    )
    return getattr(tokenizer, "response_initial_state", None) or ("reasoning" if opened else "normal")
