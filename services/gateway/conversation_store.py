"""The Conversations API's conversations (conversations.py): each one's items, in the gateway's memory.

Per API key (another key's conversation is not found), bounded by the response store's limits
(--response-store-entries conversations, --response-store-mb of items), the least recently used first out — never
the one being written to; lost on restart.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from .protocol import invalid
from .response_store import OwnedStore


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


class ConversationStore(OwnedStore):
    def create(self, conversation_id: str, owner: str, metadata: dict[str, str], items: list[dict]) -> Conversation:
        if not self.enabled:
            raise invalid("conversations are stored in the gateway, which has its store off "
                          "(--response-store-entries 0)", code="invalid_value")
        c = Conversation(conversation_id, owner, int(time.time()), metadata)
        with self._lock:
            self._entries[c.id] = c
            self._add(c, items)
        return c

    def items(self, conversation_id: str, owner: str) -> tuple[list[dict], int] | None:
        """A copy of the conversation's items (what a response reads before its input) and their size in bytes (as
        JSON), or None."""
        c = self.get(conversation_id, owner)
        return None if c is None else (list(c.items), c.size)

    def add(self, conversation_id: str, owner: str, items: list[dict]) -> bool:
        """Appends items (a completed response's input and output; a client's); False if the conversation is gone."""
        with self._lock:
            c = self._owned(conversation_id, owner)
            if c is None:
                return False
            self._add(c, items)
            return True

    def remove_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        with self._lock:
            c = self._owned(conversation_id, owner)
            at = next((i for i, item in enumerate(c.items) if item.get("id") == item_id), None) \
                if c is not None else None
            if at is None:
                return False
            size = _size(c.items[at])
            del c.items[at]
            c.size -= size
            self._bytes -= size
            return True

    def _add(self, c: Conversation, items: list[dict]) -> None:
        """(under the lock) past the limits the least recently used conversations go, never the one written to"""
        size = sum(_size(i) for i in items)
        if c.size + size > self._max_bytes:
            raise invalid(f"the conversation would hold more than the gateway keeps for all conversations "
                          f"(--response-store-mb {self.limits.megabytes})", param="items", code="invalid_value")
        c.items += items
        c.size += size
        self._bytes += size
        self._entries.move_to_end(c.id)
        self._evict(keep=c.id)


def _size(item: dict) -> int:
    return len(json.dumps(item, ensure_ascii=False))
