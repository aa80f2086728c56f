"""Routing keys of prompt prefixes: what a prefill worker's prefix cache tells the gateway it holds, and what the
gateway computes for a prompt, so it can send the prompt where its prefix is (services/gateway/routing.py).

A prompt's block i (tokens [i·block, (i+1)·block), block = the workers' --chunk) has the key
``BLAKE2b-64(key of block i-1 ‖ block i's token ids as little-endian u32)``, the first block's chain starting from a
fixed personalisation: a key names the whole prefix up to the end of its block, as the cache's own content keys do
(services/prefill/prefix_cache.py). Unlike those, it is not salted with the model file: a gateway does not know it,
and a worker serves one model, so the key needs to tell prompts apart, not models. 64 bits: a false match among the
few thousand blocks a worker holds is a 1 in 10^15 chance, and costs only one routing choice (the cache's own keys
decide what is served).
"""

from __future__ import annotations

import hashlib

import numpy as np

_PERSON = b"sg-prefix-route"


def route_keys(tokens, block: int, n_blocks: int | None = None) -> list[int]:
    """The keys of the first `n_blocks` full blocks of `tokens` (default: every full block)."""
    if block < 1:
        return []
    full = len(tokens) // block
    n = full if n_blocks is None else min(n_blocks, full)
    ids = np.asarray(tokens[: n * block], dtype="<u4")
    key, out = b"", []
    for i in range(n):
        key = hashlib.blake2b(key + ids[i * block:(i + 1) * block].tobytes(), digest_size=8, person=_PERSON).digest()
        out.append(int.from_bytes(key, "little"))
    return out


def cacheable_keys(tokens, block: int) -> list[int]:
    """The keys of the blocks a prefix cache can serve for this prompt: full blocks that leave at least one prompt
    token to compute (the first token is sampled from its logits)."""
    return route_keys(tokens, block, (len(tokens) - 1) // block) if block >= 1 and len(tokens) else []
