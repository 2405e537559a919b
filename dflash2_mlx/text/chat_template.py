"""Where a chat prompt's messages end: the positions ``chat`` and the server store prefix-cache snapshots at.

A saved Gated DeltaNet state only serves a prompt that extends its exact token prefix, so
snapshots go where the next prompt of the conversation will share the prefix: at message
boundaries (see docs/DESIGN "Prompt caching"). Both front ends call ``message_boundaries``, so a
conversation stores snapshots at the same positions whichever way it is held.
"""

from __future__ import annotations

from typing import Sequence

# How many of the last messages get a boundary. A new client (or a restarted server) sending a long
# conversation gets snapshots across its recent history, not only at its end; earlier turns of a
# live chat stored the older ones already. Each one costs a template rendering.
MAX_BOUNDARY_MESSAGES = 8


def message_boundaries(tokenizer, messages: Sequence[dict], prompt: Sequence[int], **template_kwargs) -> list[int]:
    """Sorted positions in ``prompt`` (a rendering of ``messages``) where a message ends, for ``save_at``.

    For each of the last ``MAX_BOUNDARY_MESSAGES`` prefixes of the conversation, the position is
    how far its own rendering (no generation prompt) agrees with ``prompt``. Where the template
    re-renders a message once later ones follow (Qwen drops the reasoning of earlier answers), the
    agreement stops at the start of what changed: that point is still a prefix of this prompt, and
    of the later prompts that extend the conversation, unlike the end of the message as rendered
    alone. Positions 0 and ``len(prompt)`` are left out (the engine saves the full prompt anyway).
    ``template_kwargs`` go to the template as for ``prompt`` (e.g. ``enable_thinking``, ``tools``).
    """
    from mlx_lm.utils import common_prefix_len

    # mlx-lm's TokenizerWrapper says whether it can render (a template or a custom renderer)
    if not getattr(tokenizer, "has_chat_template", getattr(tokenizer, "chat_template", None)):
        return []
    out = set()
    for k in range(max(1, len(messages) + 1 - MAX_BOUNDARY_MESSAGES), len(messages) + 1):
        try:
            part = tokenizer.apply_chat_template(
                list(messages[:k]), add_generation_prompt=False, tokenize=True, **template_kwargs
            )
        except Exception:  # a template may refuse a partial conversation (e.g. no user message yet)
            continue
        if isinstance(part, dict):  # a BatchEncoding from some tokenizers
            part = part["input_ids"]
        n = common_prefix_len(part, prompt)
        if 0 < n < len(prompt):
            out.add(n)
    return sorted(out)
