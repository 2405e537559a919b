"""Where the end of a token sequence occurred before: the index copy drafts are proposed from.

A ``TokenIndex`` holds token sequences (a request's own prompt and answer, or earlier answers
kept server-wide) and, for every run of ``NGRAM`` tokens in them, the latest few places it ended.
``longest_match`` takes the last tokens written and returns the earlier occurrence that agrees
with the most tokens before them, and what followed it there: the copy draft.

Why n-grams and not a suffix tree (SuffixDecoding, ArcticInference): a match must start from a
few tokens in a row to be worth a verify row, the candidates are checked backwards token by
token anyway (to rank them by how much context agrees), and a dict of n-grams is small, standard
library, and cheap to grow by the one to sixteen tokens a cycle commits. ArcticInference's tree
needs torch and vLLM to build. Lookups cost tens of microseconds in Python (a cycle is tens of
milliseconds here, far more on a 27B target).

An index with a byte budget (the shared index of earlier answers) forgets its oldest sequences
first. Its size is an estimate: ``BYTES_PER_TOKEN`` per indexed token (the list slot, the n-gram
key and its position entry).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

NGRAM = 3  # tokens in a row a match starts from: one or two tokens propose too often, wrongly
CANDIDATES = 4  # latest occurrences of an n-gram kept and compared
MAX_AGREE = 64  # tokens compared backwards to rank candidates (a longer agreement ranks the same)
BYTES_PER_TOKEN = 160  # the estimate a byte budget counts (CPython: int slot, tuple key, list entry)


@dataclass(frozen=True)
class Match:
    """An earlier occurrence of the sequence's last tokens and what followed it."""

    continuation: list[int]  # the tokens after the earlier occurrence (the copy draft)
    agreement: int  # how many tokens before the current end agree with it (>= NGRAM)
    source: str  # "context" (this request's tokens) or "shared" (earlier answers)


class TokenIndex:
    """N-gram positions over token sequences, optionally bounded in bytes (oldest forgotten first)."""

    def __init__(self, max_bytes: Optional[int] = None, source: str = "context"):
        self.max_bytes, self.source = max_bytes, source
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self.indexed: dict[int, int] = {}  # id -> n-grams indexed so far
        self.growing: list[int] = []  # ids of sequences tracked in place (``track``)
        self.grams: dict[tuple, list[tuple[int, int]]] = {}  # n-gram -> [(id, end position)], latest last
        self.tokens = 0
        self.next_id = 0
        self.lock = threading.Lock()  # a server's worker writes it while /metrics reads its size

    @property
    def bytes(self) -> int:
        return self.tokens * BYTES_PER_TOKEN

    def add(self, tokens: Sequence[int]) -> int:
        """Keep ``tokens`` as a new sequence (forgetting the oldest past the budget) -> its id."""
        with self.lock:
            seq_id, self.next_id = self.next_id, self.next_id + 1
            self.sequences[seq_id] = list(tokens)
            self.indexed[seq_id] = 0
            self._index(seq_id, final=True)
            self._enforce_budget()
            return seq_id

    def track(self, tokens: list[int]) -> int:
        """Index ``tokens`` as a sequence that grows in place (a request's committed tokens): each
        lookup first indexes what was appended since."""
        with self.lock:
            seq_id, self.next_id = self.next_id, self.next_id + 1
            self.sequences[seq_id] = tokens
            self.indexed[seq_id] = 0
            self.growing.append(seq_id)
            return seq_id

    def longest_match(self, tail: Sequence[int], max_tokens: int) -> Optional[Match]:
        """The earlier occurrence of ``tail``'s last ``NGRAM`` tokens that agrees with the most of
        ``tail`` (latest first among equals), and up to ``max_tokens`` tokens that followed it."""
        if len(tail) < NGRAM or max_tokens < 1:
            return None
        with self.lock:
            for seq_id in self.growing:
                self._index(seq_id, final=False)
            best: Optional[tuple[int, int, int]] = None  # (agreement, id, end)
            for seq_id, end in reversed(self.grams.get(tuple(tail[-NGRAM:]), ())):
                tokens = self.sequences[seq_id]
                if end + 1 >= len(tokens):
                    continue  # a kept answer's last n-gram: nothing after it to copy
                agreement = _agreement(tail, tokens, end)
                if best is None or agreement > best[0]:
                    best = (agreement, seq_id, end)
            if best is None:
                return None
            agreement, seq_id, end = best
            return Match(self.sequences[seq_id][end + 1 : end + 1 + max_tokens], agreement, self.source)

    def _index(self, seq_id: int, final: bool) -> None:
        """Index the n-grams of a sequence not indexed yet that have a token after them (all of
        them when ``final``: a kept answer's last n-gram has nothing after it to copy, but a
        later request's text may go on the same way)."""
        tokens = self.sequences[seq_id]
        last_end = len(tokens) - (1 if final else 2)  # the latest end position an n-gram may have
        for end in range(self.indexed[seq_id] + NGRAM - 1, last_end + 1):
            places = self.grams.setdefault(tuple(tokens[end - NGRAM + 1 : end + 1]), [])
            places.append((seq_id, end))
            if len(places) > CANDIDATES:
                del places[0]
            self.tokens += 1
        self.indexed[seq_id] = max(self.indexed[seq_id], last_end - NGRAM + 2)

    def _enforce_budget(self) -> None:
        while self.max_bytes is not None and self.bytes > self.max_bytes and len(self.sequences) > 1:
            self._forget(next(iter(self.sequences)))

    def _forget(self, seq_id: int) -> None:
        tokens = self.sequences.pop(seq_id)
        for end in range(NGRAM - 1, NGRAM - 1 + self.indexed.pop(seq_id)):
            key = tuple(tokens[end - NGRAM + 1 : end + 1])
            places = [p for p in self.grams.get(key, ()) if p[0] != seq_id]
            if places:
                self.grams[key] = places
            else:
                self.grams.pop(key, None)
            self.tokens -= 1


def _agreement(tail: Sequence[int], tokens: Sequence[int], end: int) -> int:
    """How many tokens agree going backwards from ``tail``'s end and ``tokens[end]``."""
    n = 0
    limit = min(len(tail), end + 1, MAX_AGREE)
    while n < limit and tail[-1 - n] == tokens[end - n]:
        n += 1
    return n


class SharedIndexes:
    """The server-wide indexes of earlier answers, one per API key (or one for requests without
    a key), so that one key's text is never proposed to another key's requests. Each has its own
    byte budget."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.by_key: dict[str, TokenIndex] = {}
        self.lock = threading.Lock()

    def for_key(self, key: str) -> TokenIndex:
        with self.lock:
            index = self.by_key.get(key)
            if index is None:
                index = self.by_key[key] = TokenIndex(self.max_bytes, source="shared")
            return index

    @property
    def bytes(self) -> int:
        with self.lock:
            return sum(index.bytes for index in self.by_key.values())
