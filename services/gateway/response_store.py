"""The Responses API's stored responses: what `previous_response_id`, `GET /v1/responses/{id}`, its `input_items`
and `DELETE` read (responses.py).

In the gateway's memory, bounded by count and by bytes (--response-store-entries, --response-store-mb); the least
recently used response goes first. Each entry holds its own input items and its response, and names the response it
continued: a conversation is read by walking back that chain, so a long one costs its items once, not once per turn,
and reading a conversation marks every response in it as used (an active conversation is not evicted from under its
client). A chain whose older part was evicted cannot be continued: the request is refused, never answered with part
of its history.

Responses are kept per API key: with keys configured a response is visible only to requests made with the key that
created it (another key gets the same 404 as an unknown id). Without keys the API is open and so is the store. The
store is one gateway's: behind several gateway replicas a conversation continues only on the replica that holds it
(docs/responses.md).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_ENTRIES = 1024
DEFAULT_MEGABYTES = 64


DEFAULT_BACKGROUND = 64


@dataclass
class StoreLimits:
    entries: int = DEFAULT_ENTRIES      # 0: nothing is stored (store: true answers as if false)
    megabytes: int = DEFAULT_MEGABYTES
    background: int = DEFAULT_BACKGROUND   # background responses running at once (background.py; 0: none)


@dataclass
class Stored:
    owner: str
    response: dict             # the response object as answered
    input_items: list[dict]    # the items this request added (previous_response_id's are the previous entries')
    previous: str | None
    size: int


class ChainBroken(LookupError):
    """A response of the chain is no longer stored (evicted or deleted): the conversation cannot be rebuilt."""


class OwnedStore:
    """Entries (each with an `owner` and a `size` in bytes) by id, seen only by their owner, the least recently used
    first out past the limits: the bookkeeping of stored responses and of conversations (conversation_store.py)."""

    def __init__(self, limits: StoreLimits | None = None):
        self.limits = limits or StoreLimits()
        self._max_bytes = self.limits.megabytes << 20
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()   # the render threads read conversations while the event loop stores

    @property
    def enabled(self) -> bool:
        return self.limits.entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def _owned(self, key: str, owner: str):
        """(under the lock) the entry if `owner` may see it"""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.owner == owner else None

    def get(self, key: str, owner: str):
        with self._lock:
            entry = self._owned(key, owner)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def delete(self, key: str, owner: str) -> bool:
        with self._lock:
            entry = self._owned(key, owner)
            if entry is None:
                return False
            del self._entries[key]
            self._bytes -= entry.size
            return True

    def _evict(self, keep: str | None = None) -> None:
        """(under the lock) the least recently used entries out until the limits hold, never `keep`"""
        while len(self._entries) > self.limits.entries or self._bytes > self._max_bytes:
            key, gone = next(iter(self._entries.items()))
            if key == keep:
                return
            del self._entries[key]
            self._bytes -= gone.size


class ResponseStore(OwnedStore):
    def put(self, owner: str, response: dict, input_items: list[dict], previous: str | None) -> bool:
        """Keeps a finished response (evicting the least recently used past the limits). False when it cannot be
        kept: the store is off, or this one entry is larger than the whole store may be."""
        if not self.enabled:
            return False
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(input_items, ensure_ascii=False))
        if size > self._max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self._bytes -= old.size
            self._entries[response["id"]] = Stored(owner, response, input_items, previous, size)
            self._bytes += size
            self._evict()
        return True

    def conversation(self, response_id: str, owner: str) -> tuple[list[dict], int] | None:
        """Every item of the conversation up to and including response `response_id`'s output, oldest first (each
        response's input items, then its output items), and their size in bytes (as JSON); None when `response_id`
        is not stored for `owner`, ChainBroken when a response before it no longer is."""
        chain: list[Stored] = []
        with self._lock:
            rid: str | None = response_id
            while rid is not None:
                entry = self._owned(rid, owner)
                if entry is None:
                    if not chain:
                        return None
                    raise ChainBroken(rid)
                chain.append(entry)
                if len(chain) > len(self._entries):
                    raise ChainBroken(rid)  # a cycle: only a reused id could make one
                rid = entry.previous
            for entry in chain:
                self._entries.move_to_end(entry.response["id"])
        items: list[dict] = []
        for entry in reversed(chain):
            items += entry.input_items
            items += entry.response["output"]
        return items, sum(entry.size for entry in chain)
