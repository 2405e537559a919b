"""Snapshots of the caches after a prompt prefix, reusable by any prompt that extends it exactly.

A Gated DeltaNet state cannot be trimmed back, so a snapshot is reusable only by a prompt that
starts with exactly its tokens. The engine stores snapshots at the end of each prompt's prefill
and at caller-given positions inside it (chat message boundaries), where later prompts really
share the prefix. Entries are evicted least-recently-used first to stay under a byte budget.

With a ``disk.DiskPrefixCache`` behind it, every stored snapshot is also written to disk (on
a background thread), and a lookup that finds a longer prefix on disk than in memory reads it back:
the cache then survives restarts, eviction, and snapshots too big for the memory budget.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence

# PrefixEntry lives below this module and the disk cache (``snapshot``); importable from here too
from dflash2_mlx.caches.snapshot import PrefixEntry

if TYPE_CHECKING:
    from dflash2_mlx.caches.disk import DiskPrefixCache

log = logging.getLogger("dflash2_mlx.caches.prefix")


class PrefixCache:
    """A bounded (bytes) LRU of prefix snapshots for one target (and drafter)."""

    def __init__(self, max_bytes: int = 2 * 2**30, disk: "Optional[DiskPrefixCache]" = None):
        self.max_bytes = max_bytes
        self.disk = disk
        self._entries: "OrderedDict[tuple[int, ...], PrefixEntry]" = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0
        self.disk_hits = 0  # hits read back from disk
        self.too_large = 0  # snapshots bigger than the memory budget (kept on disk only, if there is one)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int], need_context: bool) -> Optional[PrefixEntry]:
        """The longest stored prefix of ``tokens`` usable for this request, or None.

        The whole prompt counts only when its logits were stored; otherwise at least one token
        must remain to be prefilled (the first generated token needs the last row's logits).
        """
        best = None
        for key, entry in self._entries.items():
            n = len(key)
            if n > len(tokens) or (best is not None and n <= len(best.tokens)):
                continue
            if n == len(tokens) and entry.last_logits is None:
                continue
            if need_context and entry.context is None:
                continue
            if tuple(tokens[:n]) == key:
                best = entry
        if self.disk is not None:
            restored = self.disk.lookup(tokens, need_context, longer_than=len(best.tokens) if best else 0)
            if restored is not None:
                self.disk_hits += 1
                self._keep(restored)
                best = restored
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        if best.tokens in self._entries:
            self._entries.move_to_end(best.tokens)
        return best

    def store(self, entry: PrefixEntry) -> None:
        old = self._entries.get(entry.tokens)
        if old is not None:
            if entry.context is None and old.context is not None:
                entry.context = old.context  # keep what a speculative request already paid for
            if entry.last_logits is None:
                entry.last_logits = old.last_logits
        if not self._keep(entry) and self.max_bytes > 0:
            self.too_large += 1
            where = (
                "kept on disk only"
                if self.disk is not None
                else "not stored (raise the prefix cache budget, or use a prompt cache directory)"
            )
            (log.warning if self.too_large == 1 else log.info)(
                "prefix cache: a %d-token snapshot (%.0f MB) is larger than the in-memory budget (%.0f MB): %s",
                len(entry.tokens),
                entry.nbytes / 1e6,
                self.max_bytes / 1e6,
                where,
            )
        if self.disk is not None:
            self.disk.store(entry)

    def _keep(self, entry: PrefixEntry) -> bool:
        """Hold ``entry`` in memory (evicting the least recently used); False if it cannot fit."""
        old = self._entries.pop(entry.tokens, None)
        if old is not None:
            self.nbytes -= old.nbytes
        size = entry.nbytes
        if size > self.max_bytes:
            return False
        self._entries[entry.tokens] = entry
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
