"""The Conversations API's conversations (conversations.py): each one's items, in the gateway's memory.

Per API key (another key's conversation is not found), bounded by the response store's limits
(--response-store-entries conversations, --response-store-mb of items), the least recently used first out — never
the one being written to; lost on restart.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .protocol import invalid
from .response_store import StoreLimits


@dataclass
class Conversation:
    id: str
    owner: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict] = field(default_factory=list)
    size: int = 0

    def body(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationStore:
    def __init__(self, limits: StoreLimits | None = None):
        self.limits = limits or StoreLimits()
        self._max_bytes = self.limits.megabytes << 20
        self._entries: OrderedDict[str, Conversation] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()   # the render threads read conversations while the event loop adds to them

    @property
    def enabled(self) -> bool:
        return self.limits.entries > 0

    def create(self, conversation_id: str, owner: str, metadata: dict[str, str], items: list[dict]) -> Conversation:
        if not self.enabled:
            raise invalid("conversations are stored in the gateway, which has its store off "
                          "(--response-store-entries 0)", code="invalid_value")
        c = Conversation(conversation_id, owner, int(time.time()), metadata)
        with self._lock:
            self._entries[c.id] = c
            self._add(c, items)
        return c

    def get(self, conversation_id: str, owner: str) -> Conversation | None:
        with self._lock:
            c = self._entries.get(conversation_id)
            if c is None or c.owner != owner:
                return None
            self._entries.move_to_end(conversation_id)
            return c

    def items(self, conversation_id: str, owner: str) -> tuple[list[dict], int] | None:
        """A copy of the conversation's items (what a response reads before its input) and their size in bytes (as
        JSON), or None."""
        with self._lock:
            c = self._entries.get(conversation_id)
            if c is None or c.owner != owner:
                return None
            self._entries.move_to_end(conversation_id)
            return list(c.items), c.size

    def add(self, conversation_id: str, owner: str, items: list[dict]) -> bool:
        """Appends items (a completed response's input and output; a client's); False if the conversation is gone."""
        with self._lock:
            c = self._entries.get(conversation_id)
            if c is None or c.owner != owner:
                return False
            self._add(c, items)
            return True

    def remove_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        with self._lock:
            c = self._entries.get(conversation_id)
            at = next((i for i, item in enumerate(c.items) if item.get("id") == item_id), None) \
                if c is not None and c.owner == owner else None
            if at is None:
                return False
            size = _size(c.items[at])
            del c.items[at]
            c.size -= size
            self._bytes -= size
            return True

    def delete(self, conversation_id: str, owner: str) -> bool:
        with self._lock:
            c = self._entries.get(conversation_id)
            if c is None or c.owner != owner:
                return False
            del self._entries[conversation_id]
            self._bytes -= c.size
            return True

    def _add(self, c: Conversation, items: list[dict]) -> None:
        # (under the lock) past the limits the least recently used conversations go, never the one written to
        size = sum(_size(i) for i in items)
        if c.size + size > self._max_bytes:
            raise invalid(f"the conversation would hold more than the gateway keeps for all conversations "
                          f"(--response-store-mb {self.limits.megabytes})", param="items", code="invalid_value")
        c.items += items
        c.size += size
        self._bytes += size
        self._entries.move_to_end(c.id)
        while len(self._entries) > self.limits.entries or self._bytes > self._max_bytes:
            gone_id, gone = next(iter(self._entries.items()))
            if gone_id == c.id:
                break
            del self._entries[gone_id]
            self._bytes -= gone.size


def _size(item: dict) -> int:
    return len(json.dumps(item, ensure_ascii=False))
