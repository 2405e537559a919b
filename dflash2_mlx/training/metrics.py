"""The numbers that make a tiny pair's acceptance mean something: repetition and a trivial baseline.

A weak target falls into loops any drafter predicts, so the build reports the repetition rate of
its outputs and the acceptance a prompt-lookup n-gram drafter would reach on the same outputs.
"""

from __future__ import annotations

__all__ = [
    "prompt_lookup_acceptance",
    "prompt_lookup_draft",
    "repetition_rate",
]


def repetition_rate(tokens: list[int], n: int = 4) -> tuple[int, int]:
    """(repeated, total) n-grams of ``tokens``: an n-gram is repeated if it occurred earlier."""
    seen, repeated, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        total += 1
        if gram in seen:
            repeated += 1
        seen.add(gram)
    return repeated, total


def prompt_lookup_draft(history: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup drafting: the k tokens that followed the latest earlier occurrence of the
    longest trailing n-gram (n = max_ngram..1) of ``history``; [] when none recurs."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        pattern = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == pattern:
                draft = history[start + n : start + n + k]
                if draft:
                    return draft
    return []


def prompt_lookup_acceptance(prompt: list[int], output: list[int], block_size: int) -> tuple[int, int]:
    """(cycle tokens, cycles) of speculative decoding at temperature 0 with a prompt-lookup
    drafter, replayed against the target's greedy ``output`` (which it would reproduce exactly):
    the first token comes from the prefill; each cycle drafts block_size - 1 tokens, accepts the
    prefix that matches and adds the target's bonus token."""
    history, pos, cycles, emitted = list(prompt) + output[:1], 1, 0, 0
    while pos < len(output):
        draft = prompt_lookup_draft(history, block_size - 1)
        a = 0
        while a < len(draft) and pos + a < len(output) and draft[a] == output[pos + a]:
            a += 1
        new = output[pos : pos + a + 1]
        history += new
        pos += len(new)
        emitted += len(new)
        cycles += 1
    return emitted, cycles
