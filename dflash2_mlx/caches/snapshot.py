"""One prefix snapshot (``PrefixEntry``): the caches after a prompt prefix, the unit both the
in-memory prefix cache (``prefix``) and the disk cache (``disk``) store. It sits below both so that
neither refers to the other for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from dflash2_mlx.caches.drafter_context import ContextCache
from dflash2_mlx.caches.target import CacheSnapshot


@dataclass
class PrefixEntry:
    tokens: tuple[int, ...]
    target: CacheSnapshot
    context: Optional[ContextCache]  # the drafter's context cache; None when stored by plain decoding
    last_logits: Optional[mx.array]  # [1, V] logits after the last token (end-of-prompt entries)

    @property
    def nbytes(self) -> int:
        n = self.target.nbytes + (self.context.nbytes if self.context is not None else 0)
        return n + (self.last_logits.nbytes if self.last_logits is not None else 0)
