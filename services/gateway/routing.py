"""Which prefill worker a prompt goes to: where its prefix is cached, else where prompts sharing its first block
go, else the least loaded; only among healthy workers, so a worker that went down is passed over at once.

The prefix cache lives in each prefill worker (services/prefill/prefix_cache.py), so a prompt is cheapest where the
longest prefix of it is cached. The gateway knows which blocks each worker holds: every worker reports the routing
keys of its cached blocks (Prefill.PrefixIndex, asked by the health monitor whenever PrefixCacheStats.version moves,
i.e. at most one probe interval late), and between two reports the gateway adds the blocks of each prompt a worker
just ran there (a worker with its cache on keeps every full block it computes). The keys are
splitgemma/serving/prefix_keys.py's chains over the token ids, so a match on block i means the whole prefix up to
block i is there.

The order of the rules, and why:

1. Known prefix: among workers not overloaded (at most AFFINITY_SLACK calls in flight beyond the least loaded one),
   the one holding the most leading blocks of the prompt; ties by load. A hit there skips those blocks' compute.
2. No worker holds any of it: rendezvous hashing on the prompt's first block picks the worker, so prompts that
   share a prefix meet on one worker from their first request on (the second is then a hit by rule 1) instead of
   each worker computing and caching the same prefix; a worker coming or going moves only the prefixes it owned.
3. Otherwise (no full block, or the chosen worker overloaded): the least loaded worker, round robin among equals.

Why the slack: a prefill worker runs one chunk at a time for all its calls (docs/scheduling.md), so past a few
extra calls on the worker holding a prompt's prefix, a miss on an idle worker finishes sooner than a hit that
queues. Measured with bench/bench_routing.py (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib

AFFINITY_SLACK = 2


def held_blocks(prefixes: set[int], keys: list[int]) -> int:
    """How many leading blocks of a prompt (its routing keys, in order) a worker holding `prefixes` has."""
    n = 0
    for k in keys:
        if k not in prefixes:
            break
        n += 1
    return n


def rendezvous(workers: list, key: int):
    """The worker that owns `key` by rendezvous (highest random weight) hashing over the workers' addresses."""
    seed = key.to_bytes(8, "little")
    return max(workers, key=lambda w: hashlib.blake2b(seed + w.address.encode(), digest_size=8).digest())


def pick(healthy: list, keys: list[int], turn: int):
    """The prefill worker for a prompt with routing keys `keys` (prefix_keys.cacheable_keys; empty when it has no
    full block) among `healthy` (non-empty; each with .in_flight, .prefixes and .address); `turn` is a counter for
    the round robin. Returns (worker, reason): reason is "prefix", "rendezvous" or "load" (metrics)."""
    least = min(w.in_flight for w in healthy)
    eligible = [w for w in healthy if w.in_flight <= least + AFFINITY_SLACK]
    if keys:
        held = {id(w): held_blocks(w.prefixes, keys) for w in eligible}
        best = max(held.values())
        if best:
            return min((w for w in eligible if held[id(w)] == best), key=lambda w: w.in_flight), "prefix"
        owner = rendezvous(healthy, keys[0])
        if owner in eligible:
            return owner, "rendezvous"
    tied = [w for w in healthy if w.in_flight == least]
    return tied[turn % len(tied)], "load"
