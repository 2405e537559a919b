"""The drafter's context cache and the target features it has not absorbed yet.

Every committed position's tapped target features must reach the drafter's context before a
block drafted after it, so that speculation can resume exactly after plain steps. A block's rows
go in right away (tentatively, when the next block is drafted before this one's verdict is read);
plain steps' rows are queued and absorbed a batch at a time, or before the next draft.
"""

from __future__ import annotations

import mlx.core as mx

from dflash2_mlx.caches.drafter_context import ContextCache
from dflash2_mlx.models.drafter import Drafter

UNSEEN_BATCH = 32  # plain steps' feature rows are moved into the drafter's context this many at a time


class ContextFeed:
    """One request's drafter context and its queue of not yet absorbed feature rows."""

    def __init__(self, drafter: Drafter, context: ContextCache):
        self.drafter, self.context = drafter, context
        self.unseen: list[mx.array] = []  # target features [1, r, F] of committed positions the context lacks

    def queue(self, features: mx.array) -> None:
        """Committed rows [1, r, F] for the context, absorbed later."""
        self.unseen.append(features)

    def absorb_queued(self) -> None:
        """Bring the context up to date (before a draft, and at the end of a request)."""
        if self.unseen:
            rows = mx.concatenate(self.unseen, axis=1) if len(self.unseen) > 1 else self.unseen[0]
            self.drafter.absorb(rows, self.context)
            self.unseen.clear()

    def absorb_tentatively(self, features: mx.array, keep: mx.array) -> None:
        """A block's rows [1, b, F] before its verdict is read: only the first ``keep`` [1] count."""
        self.drafter.absorb(features, self.context, valid=keep)

    def keep_block(self, features: mx.array, block_size: int, accepted: int) -> None:
        """After a cycle's verdict: its kept rows (accepted drafts + the anchor's) stay."""
        if self.context.tentative is not None:
            self.context.commit(accepted + 1)
        elif block_size > 1:
            self.unseen.append(features[:, : accepted + 1])
        if len(self.unseen) >= UNSEEN_BATCH:
            self.absorb_queued()
