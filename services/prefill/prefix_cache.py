"""The prefill worker's automatic prefix cache (docs/scheduling.md, "Prefix cache").

Content-addressed blocks of K/V, as vLLM's automatic prefix caching: a prompt is cut into blocks of `chunk` tokens,
and block i's key is a hash over block i-1's key and block i's token ids, so a key names the whole prefix up to the
end of its block. The chain starts from a salt naming everything else the K/V depends on (the model file, the K/V
element type, the weights policy, the chunk), so a block is never served to a model or layout that would have
computed other bytes.

Why the blocks are captured during the prefill: a sliding-window layer keeps only its last `sliding_window +
chunk` positions in the slot, so by the end of a long prompt its early rows are gone. `capture` copies each full
block out of the slot right after the chunk that computed it (KvArena.export_positions, every KV layer). `restore`
writes the longest cached chain back into a fresh slot (KvArena.import_positions: full layers by position, sliding
layers only the last ring's worth) and the run prefills the rest from there.

Why a block is one chunk: the engine's K/V and logits do not depend on how rows are grouped into passes, except
under the auto:M weights policy (a pass of fewer than M rows uses the int4 weights). Restoring at a multiple of
`chunk` and prefilling onward in chunks makes exactly the passes an uncached run makes, so a hit is bit-identical to
a miss. The restore point leaves at least one prompt token to run: the first token is sampled from its logits.

Each block also carries its routing key (splitgemma/serving/prefix_keys.py: the same chain over the token ids,
unsalted), which Prefill.PrefixIndex reports so a gateway can send a prompt where its prefix is; `version` changes
whenever a block comes or goes, so the gateway asks again only then.

Eviction: least recently used first, within a byte budget, and only blocks no other cached block extends (leaves),
so no block is kept whose prefix is gone. The calls run on the model thread; Stats reads the counters from the
event loop (plain ints).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from splitgemma.serving.prefix_keys import route_keys
from splitgemma.v1 import serving_pb2 as pb


@dataclass(eq=False)
class _Block:
    data: bytes                # KvArena.export_positions of the block's positions
    parent: bytes | None       # key of the block before it (None: the first block of a prompt)
    route: int = 0             # its routing key (prefix_keys.route_keys)
    children: int = 0          # cached blocks whose parent this is


class PrefixCache:
    """Blocks of exported K/V under content keys, LRU-evicted within `budget_bytes` (0: the cache is off)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._salts: dict[int, tuple[object, bytes]] = {}         # id(model) -> (model, salt)
        self.bytes = 0
        self.queries = self.queried_tokens = self.hit_tokens = self.evictions = 0
        self.version = 0  # bumped on every block added or evicted

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    # -- keys ----------------------------------------------------------------------------------------------------

    def _salt(self, model) -> bytes:
        entry = self._salts.get(id(model))
        if entry is None:
            # The layout signature covers shapes and tensor offsets, not the weights' values (two checkpoints of one
            # shape share it), so the file's identity joins it; the K/V also depend on their element type, the
            # weights policy (auto:M picks int8 or int4 per pass) and the chunk (the pass boundaries).
            try:
                st = os.stat(model.path)
                identity = f"{os.path.realpath(model.path)}|{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
            except OSError:  # the file is gone (it stays mapped): this Model object alone can match these keys
                identity = f"unnamed model object {id(model)}"
            text = (f"splitgemma-prefix-v1|{model.layout_signature:016x}|{identity}|{model.kv_layout['kv_dtype']}|"
                    f"{model.kv_layout['position_bytes']}|{model.weights}|{model.chunk}")
            entry = (model, hashlib.blake2b(text.encode(), digest_size=16).digest())
            self._salts[id(model)] = entry
        return entry[1]

    def keys(self, model, tokens, n_blocks: int) -> list[bytes]:
        """The content keys of the first n_blocks full blocks of `tokens` for `model`."""
        block = model.chunk
        ids = np.asarray(tokens[: n_blocks * block], dtype="<u4")
        key = self._salt(model)
        out = []
        for i in range(n_blocks):
            key = hashlib.blake2b(key + ids[i * block:(i + 1) * block].tobytes(), digest_size=16).digest()
            out.append(key)
        return out

    # -- the two calls from the prompt run ---------------------------------------------------------------------

    def restore(self, arena, slot: int, tokens, parts: list | None = None) -> int:
        """Write the longest cached prefix of `tokens` into `slot` (under the caller's writer lock, before the first
        chunk) and return its length: the position to prefill the rest from (0 on a miss). The blocks' exports are
        appended to `parts` when given (the network transport sends them on: a sliding layer's ring in `slot` no
        longer holds a long prefix's first positions)."""
        if not self.enabled:
            return 0
        model = arena.model
        self.queries += 1
        self.queried_tokens += len(tokens)
        hits: list[bytes] = []
        for key in self.keys(model, tokens, (len(tokens) - 1) // model.chunk):  # leave >= 1 token to run
            if key not in self._blocks:
                break
            hits.append(key)
        if not hits:
            return 0
        for key in reversed(hits):  # the first block ends most recent: a chain is evicted from its end
            self._blocks.move_to_end(key)
        data = [self._blocks[k].data for k in hits]
        arena.import_positions(slot, 0, data)
        if parts is not None:
            parts.extend(data)
        n = len(hits) * model.chunk
        self.hit_tokens += n
        return n

    def capture(self, arena, slot: int, tokens, pos0: int, n: int) -> None:
        """Keep the full blocks that the prefill of tokens[pos0:pos0 + n] (just run into `slot`) completed."""
        if not self.enabled:
            return
        model = arena.model
        block = model.chunk
        first, last = pos0 // block, (pos0 + n) // block  # blocks [first, last) end inside (pos0, pos0 + n]
        if last <= first:
            return
        keys, routes = self.keys(model, tokens, last), route_keys(tokens, block, last)
        for i in range(first, last):
            key, parent = keys[i], keys[i - 1] if i else None
            if key in self._blocks:
                continue
            if parent is not None and parent not in self._blocks:
                return  # its prefix was evicted meanwhile: the block could never be reached
            need = block * model.kv_layout["position_bytes"]
            if need > self.budget_bytes:
                return  # the budget is smaller than one block
            self._make_room(need, keep=parent)
            if self.bytes + need > self.budget_bytes:
                return  # everything left is an ancestor of this block
            data = arena.export_positions(slot, i * block, (i + 1) * block)
            self._blocks[key] = _Block(data, parent, routes[i])
            self.bytes += len(data)
            self.version += 1
            if parent is not None:
                self._blocks[parent].children += 1

    def _make_room(self, need: int, keep: bytes | None) -> None:
        """Evict least recently used leaves until `need` more bytes fit (never `keep`, the new block's parent)."""
        while self.bytes + need > self.budget_bytes:
            victim = next((k for k, b in self._blocks.items() if b.children == 0 and k != keep), None)
            if victim is None:
                return
            b = self._blocks.pop(victim)
            self.bytes -= len(b.data)
            self.evictions += 1
            self.version += 1
            if b.parent is not None:
                self._blocks[b.parent].children -= 1

    # -- reporting -----------------------------------------------------------------------------------------------

    def route_index(self) -> tuple[int, list[int]]:
        """(version, the routing keys of every block held). Called on the event loop while the model thread may add
        blocks: a copy first, retried if the dict changed under it."""
        while True:
            version = self.version
            try:
                keys = [b.route for b in list(self._blocks.values())]
            except RuntimeError:  # changed size during iteration
                continue
            return version, keys

    def stats(self) -> pb.PrefixCacheStats:
        """The counters (block_tokens is the model's chunk: the caller's to fill)."""
        return pb.PrefixCacheStats(budget_bytes=self.budget_bytes, queries=self.queries,
                                   queried_tokens=self.queried_tokens, hit_tokens=self.hit_tokens, bytes=self.bytes,
                                   blocks=self.blocks, evictions=self.evictions, version=self.version)


class PrefixCacheCollector:
    """The cache's counters as Prometheus metrics, read at scrape time (registry.register(...))."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache

    def collect(self):
        c = self.cache
        for name, doc, value in (
                ("queries", "prompts looked up in the prefix cache", c.queries),
                ("queried_tokens", "prompt tokens looked up in the prefix cache", c.queried_tokens),
                ("hit_tokens", "prompt tokens restored from the prefix cache (hit rate: over queried_tokens)",
                 c.hit_tokens),
                ("evictions", "prefix cache blocks evicted to stay within the budget", c.evictions)):
            yield CounterMetricFamily(f"splitgemma_prefill_prefix_cache_{name}", doc, value=value)
        for name, doc, value in (("bytes", "K/V bytes held by the prefix cache", c.bytes),
                                 ("blocks", "blocks held by the prefix cache", c.blocks),
                                 ("budget_bytes", "the prefix cache's byte budget (0: off)", c.budget_bytes)):
            yield GaugeMetricFamily(f"splitgemma_prefill_prefix_cache_{name}", doc, value=value)
