"""Stored responses for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, bounded.

Each entry keeps one response's own input items, its output items and the id of the response it
continued, so a chain of N turns costs N entries, not N^2 items. Entries are evicted least recently
used first once there are more than ``max_entries`` or their JSON size passes ``max_bytes``; using
a response (continuing it, retrieving it) refreshes it and every response before it in its chain.
Nothing survives a restart of the server.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass
class StoredResponse:
    response: dict  # the Response object as the API returned it
    input_items: list[dict]  # this turn's input items (not the earlier turns')
    previous_id: Optional[str]
    nbytes: int


class ChainBroken(KeyError):
    """A response, or one before it in its chain, is not (or no longer) stored."""


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, input_items: list[dict]) -> None:
        """Keep a finished response (a response larger than the whole store is not kept)."""
        nbytes = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(input_items, ensure_ascii=False))
        entry = StoredResponse(response, input_items, response.get("previous_response_id"), nbytes)
        with self._lock:
            if nbytes > self.max_bytes:
                return
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[response["id"]] = entry
            self.nbytes += nbytes
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes

    def get(self, response_id: str) -> Optional[dict]:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
            return entry.response

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self.nbytes -= entry.nbytes
            return entry is not None

    def conversation(self, response_id: str) -> list[dict]:
        """Every input and output item of the chain ending at ``response_id``, oldest first, as
        input items; raises ``ChainBroken`` naming the first missing response."""
        with self._lock:
            chain, seen, rid = [], set(), response_id
            while rid is not None and rid not in seen:
                entry = self._entries.get(rid)
                if entry is None:
                    raise ChainBroken(rid)
                seen.add(rid)
                chain.append((rid, entry))
                rid = entry.previous_id
            for rid, _ in reversed(chain):  # refresh the oldest first, so the newest is kept longest
                self._entries.move_to_end(rid)
        items: list[dict] = []
        for _, entry in reversed(chain):
            items += entry.input_items
            items += entry.response.get("output", [])
        return items
