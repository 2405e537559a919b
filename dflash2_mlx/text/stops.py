"""Stop strings over streamed text."""

from __future__ import annotations

from typing import Optional, Sequence


class StopStrings:
    """Streams text through, holding back any tail that may still become a stop string.

    ``feed`` returns the text that is safe to show and whether a stop string was completed (the
    stop string and anything after it are never shown).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit = False

    def feed(self, segment: str, final: bool = False) -> tuple[str, bool]:
        if not self.stops:
            return segment, False
        self.pending += segment
        found = [(self.pending.find(s), s) for s in self.stops]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            i = min(i for i, _ in found)
            text, self.pending, self.hit = self.pending[:i], "", True
            return text, True
        if final:
            text, self.pending = self.pending, ""
            return text, False
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        text = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(text) :]
        return text, False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def encode_prompt(tokenizer, prompt: str, use_chat_template: bool = True, system: Optional[str] = None) -> list[int]:
    """Token ids for a user prompt: through the model's chat template when it has one."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))
