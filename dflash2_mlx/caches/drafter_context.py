"""The drafter's context cache: K/V of the projected target features of committed positions."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


class ContextCache:
    """Per-layer K/V of the drafter's context rows (projected target features), in fixed buffers.

    Only committed positions enter; the block's own K/V are never stored. Rows live in buffers
    [1, Hkv, C, D] whose capacity C doubles (from ``MIN_CAPACITY``) up to ``limit``, the rows any
    later block can still see (the drafter's context window, W-1; None: unbounded), and then wraps
    around as a ring. A cycle writes only its new rows, and the block step sees the same shapes
    cycle after cycle: that is what lets it be compiled and keeps its cost flat at long context.
    ``positions`` [C] holds each slot's absolute position (-1: empty); the masks come from it.

    A write can be tentative: n rows of which only the first ``valid`` (an array, not yet
    computed) are kept, the rest stored as empty. The decode loop writes a verify pass's rows so
    before it knows how many were accepted, and drafts the next block on top (``next_position``),
    then calls ``commit``. The ring keeps ``headroom`` slots beyond the limit, so that a tentative
    write never overwrites a row a later block can still see.
    """

    MIN_CAPACITY = 256

    def __init__(self, limit: Optional[int], headroom: int = 0):
        self.limit, self.headroom = limit, headroom
        self.keys: list[mx.array] = []  # per layer [1, Hkv, C, D]
        self.values: list[mx.array] = []
        self.positions: Optional[mx.array] = None  # [C] int32
        self.offset = 0  # absolute position of the next context row
        self.start = 0  # the position whose row is in slot 0 (slot of p: (p - start) % C)
        self.tentative: Optional[tuple[int, mx.array]] = None  # (rows written, rows to keep [1])

    @property
    def capacity(self) -> int:
        return 0 if self.positions is None else self.positions.shape[0]

    def write(self, rows: list[tuple[mx.array, mx.array]], valid: Optional[mx.array] = None) -> None:
        """Store per layer the K/V [1, Hkv, n, D] of positions offset..offset+n-1; with ``valid``
        [1] int32, tentatively: rows from ``valid`` on are stored as empty until ``commit``."""
        assert self.tentative is None, "commit the tentative write first"
        n = rows[0][0].shape[2]
        if valid is not None:
            assert n <= self.headroom, f"a tentative write of {n} rows needs that much headroom"
        elif self.limit is not None and n > self.limit:  # only the last `limit` can be seen again
            self.skip(n - self.limit)
            rows = [(k[:, :, n - self.limit :], v[:, :, n - self.limit :]) for k, v in rows]
            n = self.limit
        needed = self.offset + n - self.start
        if needed > self.capacity and (self.limit is None or self.capacity < self._max_capacity):
            self._grow(needed, rows)
        capacity = self.capacity
        first = (self.offset - self.start) % capacity
        pieces = [(first, 0, min(n, capacity - first))]  # (slot, row from, row to): at most one wrap
        if n > capacity - first:
            pieces.append((0, capacity - first, n))
        for slot, lo, hi in pieces:
            at = mx.array([0, 0, slot, 0], dtype=mx.int32)
            for layer, (k, v) in enumerate(rows):
                # slice_update makes a new array: copies (prefix cache snapshots) keep theirs
                self.keys[layer] = mx.slice_update(self.keys[layer], k[:, :, lo:hi], at, (0, 1, 2, 3))
                self.values[layer] = mx.slice_update(self.values[layer], v[:, :, lo:hi], at, (0, 1, 2, 3))
            pos = mx.arange(self.offset + lo, self.offset + hi, dtype=mx.int32)
            if valid is not None:
                pos = mx.where(mx.arange(lo, hi, dtype=mx.int32) < valid, pos, -1)
            self.positions = mx.slice_update(self.positions, pos, mx.array([slot], dtype=mx.int32), (0,))
        if valid is None:
            self.offset += n
        else:
            self.tentative = (n, valid)

    def commit(self, kept: int) -> None:
        """Keep the first ``kept`` rows of the tentative write (what its ``valid`` computed)."""
        assert self.tentative is not None and kept <= self.tentative[0]
        self.offset += kept
        self.tentative = None

    def next_position(self) -> tuple[mx.array, int]:
        """(the position [1] int32 of the next row, an upper bound of it as an int): a block is
        drafted there, also on top of a tentative write."""
        if self.tentative is None:
            return mx.array([self.offset], dtype=mx.int32), self.offset
        n, valid = self.tentative
        return self.offset + valid, self.offset + n

    @property
    def _max_capacity(self) -> int:
        return self.limit + self.headroom

    def _grow(self, needed: int, rows: list[tuple[mx.array, mx.array]]) -> None:
        capacity = max(self.MIN_CAPACITY, self.capacity)
        while capacity < needed:
            capacity *= 2
        if self.limit is not None:
            capacity = min(capacity, self._max_capacity)
        old = self.capacity  # rows are still in slots 0..old-1 in order: a ring wraps only at the limit
        keys, values = [], []
        for layer, (k, _) in enumerate(rows):
            shape = (1, k.shape[1], capacity, k.shape[3])
            grown_k, grown_v = mx.zeros(shape, dtype=k.dtype), mx.zeros(shape, dtype=k.dtype)
            if old:
                grown_k[:, :, :old] = self.keys[layer]
                grown_v[:, :, :old] = self.values[layer]
            keys.append(grown_k)
            values.append(grown_v)
        positions = mx.full((capacity,), -1, dtype=mx.int32)
        if old:
            positions[:old] = self.positions
        self.keys, self.values, self.positions = keys, values, positions

    def skip(self, rows: int) -> None:
        """Advance past ``rows`` positions that no later block row can see.

        Only valid when every layer is windowed and the skipped rows are at least a window
        long: then nothing cached before them is visible anymore either, and it is dropped.
        """
        if rows <= 0:
            return
        self.offset += rows
        self.start = self.offset
        if self.positions is not None:
            self.positions = mx.full(self.positions.shape, -1, dtype=mx.int32)

    def ordered(self, layer: int) -> tuple[mx.array, mx.array, mx.array]:
        """The stored rows of one layer in position order: keys, values [1, Hkv, n, D], positions [n]."""
        if self.positions is None:
            return None, None, mx.zeros((0,), dtype=mx.int32)
        order = mx.argsort(self.positions)
        order = order[self.capacity - int((self.positions >= 0).sum().item()) :]  # empty slots (-1) sort first
        return self.keys[layer][:, :, order], self.values[layer][:, :, order], self.positions[order]

    @property
    def state(self) -> list:
        return [self.keys, self.values, self.positions]

    def copy(self) -> "ContextCache":
        assert self.tentative is None, "commit the tentative write first"
        other = ContextCache(self.limit, self.headroom)
        other.keys, other.values = list(self.keys), list(self.values)
        other.positions, other.offset, other.start = self.positions, self.offset, self.start
        return other

    @property
    def nbytes(self) -> int:
        arrays = self.keys + self.values + ([self.positions] if self.positions is not None else [])
        return sum(a.nbytes for a in arrays)
