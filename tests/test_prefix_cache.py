"""The prefill worker's automatic prefix cache (services/prefill/prefix_cache.py, docs/scheduling.md).

The oracle is an uncached run of the same engine: a prompt whose prefix comes from the cache must give the same
logits and the same slot K/V (its checksum) as one computed from scratch, on the int8 and the f16 K/V layouts, with
prompts many sliding windows long (the fixture's window is 16). In process: the native export/import, the block
chain, eviction within the budget, keys that never match another model file, K/V type or weights policy. Through
real processes (the openai client against the gateway): cached_tokens in the usage of both endpoints, streamed and
not, the greedy output equal to the uncached engine's, the worker's Stats and Prometheus metrics, a cache that is
off, and routing to the worker that holds a prefix.
"""

from __future__ import annotations

import argparse
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import fastgemma_fgm
from splitgemma.commands import byte_count
from splitgemma.engine import Model, open_arena
from splitgemma.services.prefill.prefix_cache import PrefixCache
from test_gateway import MAX_CONTEXT, MODEL_NAME, TEMPLATE, Reference, Stack, _words, greedy_completion
from tools.procs import free_ports

TAME = fastgemma_fgm("mini-e2b-tame")
SHARP = fastgemma_fgm("mini-e2b")      # the same shapes (and layout signature), other weights
CHUNK = 64                             # in-process tests: 700-token prompts are 44 sliding windows
GATEWAY_CHUNK = 200                    # through the gateway: a 1,000-token shared prefix is exactly 5 blocks
SHARED = 1000


def _model(path=TAME, kv_dtype="int8", weights="auto:16", chunk=CHUNK) -> Model:
    return Model(str(path), max_context=MAX_CONTEXT, chunk=chunk, threads=1, kv_dtype=kv_dtype, weights=weights)


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 1024, n)


def _run(model, arena, slot, tokens, cache: PrefixCache) -> tuple[int, np.ndarray]:
    """The prefill worker's prompt run (services/prefill/server.py): restore, then chunks with capture."""
    cached = cache.restore(arena, slot, tokens)
    for i in range(cached, len(tokens), model.chunk):
        logits = model.prefill(arena, slot, tokens[i:i + model.chunk], pos0=i)
        cache.capture(arena, slot, tokens, i, len(tokens[i:i + model.chunk]))
    return cached, logits


def _dirty(model, arena, slot) -> None:
    """Fill the slot's rows with another prompt's K/V, so a row a restore fails to write cannot hold the right bytes."""
    model.prefill(arena, slot, _tokens(99, 300))


def _chain_is_whole(cache: PrefixCache) -> bool:
    """Every cached block's parent is cached too, and the child counts are right."""
    blocks = cache._blocks
    children: dict[bytes, int] = {}
    for b in blocks.values():
        if b.parent is not None:
            if b.parent not in blocks:
                return False
            children[b.parent] = children.get(b.parent, 0) + 1
    return all(b.children == children.get(k, 0) for k, b in blocks.items())


# ---------------------------------------------------------------------------------------------------------------
# In process: the engine's export/import and the cache's blocks

@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
@pytest.mark.parametrize("weights", ["auto:16", "int8"])
def test_a_restored_prefix_gives_the_uncached_logits_and_kv(kv_dtype, weights):
    m = _model(kv_dtype=kv_dtype, weights=weights)
    arena = open_arena(m, 3)
    cache = PrefixCache(1 << 30)
    first = _tokens(1, 700)
    assert _run(m, arena, 0, first, cache)[0] == 0
    assert cache.blocks == 700 // CHUNK and cache.bytes == cache.blocks * CHUNK * m.kv_layout["position_bytes"]
    # Shares 650 tokens with the first prompt: 10 blocks (640) come from the cache, the rest is computed.
    second = np.concatenate([first[:650], _tokens(2, 137)])
    _dirty(m, arena, 1)
    cached, logits = _run(m, arena, 1, second, cache)
    assert cached == 640
    want = m.prefill(arena, 2, second)  # the oracle: the same engine, uncached, one call
    assert np.array_equal(logits, want)
    assert arena.n_tokens(1) == arena.n_tokens(2) == len(second)
    assert arena.checksum(1) == arena.checksum(2)  # every layer's live K/V (and scales), ring rows included
    # The same prompt again: every full block but the one holding the last token comes from the cache. Only 60
    # positions follow the restore point, fewer than a ring (80): the live ring rows of 620..639 are the restore's.
    _dirty(m, arena, 1)
    cached, logits = _run(m, arena, 1, first, cache)
    assert cached == 640 and np.array_equal(logits, m.prefill(arena, 2, first))
    assert arena.checksum(1) == arena.checksum(2)
    assert cache.queries == 3 and cache.hit_tokens == 1280 and cache.queried_tokens == 700 + 787 + 700


def test_a_prompt_of_whole_blocks_leaves_its_last_block_to_run():
    m = _model()
    arena = open_arena(m, 2)
    cache = PrefixCache(1 << 30)
    tokens = _tokens(4, 10 * CHUNK)
    _run(m, arena, 0, tokens, cache)
    assert cache.blocks == 10
    # Sent again, it restores 9 blocks: the first output token is sampled from the last prompt token's logits.
    cached, logits = _run(m, arena, 0, tokens, cache)
    assert cached == 9 * CHUNK and np.array_equal(logits, m.prefill(arena, 1, tokens))
    assert _run(m, arena, 0, tokens[:CHUNK], cache)[0] == 0  # one block: nothing may be restored


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_export_import_round_trip_and_errors(kv_dtype):
    m = _model(kv_dtype=kv_dtype)
    arena = open_arena(m, 2)
    tokens = _tokens(3, 300)
    m.prefill(arena, 0, tokens)
    pb, window = m.kv_layout["position_bytes"], m.kv_layout["sliding_window"]
    ring = min(L["cap"] for L in m.kv_layout["layers"])
    assert ring == window + CHUNK
    tail = arena.export_positions(0, 300 - ring, 300)
    assert len(tail) == ring * pb
    # Import is exact: a slot rebuilt from pieces exported while they were computed holds the same live K/V.
    parts = []
    for a, b in ((0, 30), (30, 64), (64, 100)):
        m.prefill(arena, 1, tokens[a:b], pos0=a)
        parts.append(arena.export_positions(1, a, b))
    live, checksum = arena.export_positions(1, 100 - ring, 100), arena.checksum(1)
    _dirty(m, arena, 1)
    arena.import_positions(1, 0, parts)
    assert arena.header(1)["n_tokens"] == 100 and not arena.header(1)["sealed"]
    assert arena.export_positions(1, 100 - ring, 100) == live and arena.checksum(1) == checksum
    with pytest.raises(ValueError, match=r"holds 300 positions"):
        arena.export_positions(0, 200, 301)                # past n_tokens
    with pytest.raises(ValueError, match=r"no longer holds position 10"):
        arena.export_positions(0, 10, 20)                  # overwritten in the sliding rings
    with pytest.raises(ValueError, match="not a non-empty range"):
        arena.export_positions(0, 20, 20)
    with pytest.raises(ValueError, match="not a non-empty range"):
        arena.export_positions(0, 0, 2**31 - 1)            # refused before a buffer of that size is made
    with pytest.raises(ValueError, match=f"not a positive multiple of the {pb} bytes"):
        arena.import_positions(1, 0, [tail[:-1]])
    with pytest.raises(ValueError, match="would leave a gap"):
        arena.import_positions(1, 101, [tail[:pb]])        # the slot holds 100
    with pytest.raises(ValueError, match="nothing to import"):
        arena.import_positions(1, 0, [])
    with pytest.raises(ValueError, match="exceed max_context"):
        arena.import_positions(1, 0, [bytes(pb)] * (MAX_CONTEXT + 1))
    with pytest.raises(ValueError, match="contiguous"):
        arena.import_positions(1, 0, [np.zeros((2, pb), np.uint8)[:, ::2]])
    assert arena.header(1)["n_tokens"] == 100              # refused calls changed nothing


def test_eviction_stays_within_the_budget_and_evicts_children_first():
    m = _model()
    arena = open_arena(m, 1)
    block_bytes = CHUNK * m.kv_layout["position_bytes"]
    cache = PrefixCache(5 * block_bytes)
    old = _tokens(10, 4 * CHUNK + 1)                       # a chain of 4 blocks
    _run(m, arena, 0, old, cache)
    assert cache.blocks == 4 and cache.evictions == 0
    for seed in range(11, 16):                              # 5 prompts of 2 blocks each, through a 5-block budget
        _run(m, arena, 0, _tokens(seed, 2 * CHUNK + 5), cache)
        assert cache.bytes <= cache.budget_bytes and cache.bytes == cache.blocks * block_bytes
        assert _chain_is_whole(cache)
    assert cache.evictions == 4 + 2 * 5 - 5
    # The newest prompts are still cached; the first was evicted from its end, never leaving orphans.
    assert _run(m, arena, 0, _tokens(15, 2 * CHUNK + 5), cache)[0] == 2 * CHUNK
    assert _run(m, arena, 0, old, cache)[0] == 0
    # A budget smaller than one block caches nothing (and evicts nothing for it).
    tiny = PrefixCache(block_bytes - 1)
    _run(m, arena, 0, old, tiny)
    assert tiny.blocks == tiny.bytes == tiny.evictions == 0


def test_another_model_file_kv_dtype_or_weights_policy_never_hits():
    cache = PrefixCache(1 << 30)
    tokens = _tokens(20, 3 * CHUNK)
    base = _model()
    _run(base, open_arena(base, 1), 0, tokens, cache)
    assert cache.blocks == 3
    others = {"other weights, same shapes": _model(path=SHARP), "f16 K/V": _model(kv_dtype="f16"),
              "int8 weights": _model(weights="int8")}
    # mini-e2b has mini-e2b-tame's layout signature: the key must name the file, not just its layout.
    assert others["other weights, same shapes"].layout_signature == base.layout_signature
    for what, m in others.items():
        assert cache.restore(open_arena(m, 1), 0, tokens) == 0, what
    same = _model()  # a second Model of the same file and settings computes the same K/V: it hits
    assert cache.restore(open_arena(same, 1), 0, tokens) == 2 * CHUNK


def test_a_disabled_cache_keeps_nothing():
    m = _model()
    arena = open_arena(m, 1)
    cache = PrefixCache(0)
    tokens = _tokens(30, 3 * CHUNK)
    assert _run(m, arena, 0, tokens, cache)[0] == 0
    assert _run(m, arena, 0, tokens, cache)[0] == 0
    assert cache.blocks == cache.bytes == cache.queries == 0
    with pytest.raises(ValueError, match=">= 0 bytes"):
        PrefixCache(-1)


@pytest.mark.parametrize("text, value", [("0", 0), ("1048576", 1 << 20), ("512M", 512 << 20), ("2G", 2 << 30),
                                         ("1GiB", 1 << 30), ("64k", 64 << 10)])
def test_prefix_cache_bytes_option(text, value):
    assert byte_count(text) == value


@pytest.mark.parametrize("text, why", [("1.5G", "an integer number of bytes"), ("-1", "must be >= 0"),
                                       ("lots", "an integer number of bytes")])
def test_prefix_cache_bytes_option_errors(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        byte_count(text)


# ---------------------------------------------------------------------------------------------------------------
# Through the gateway (openai client), against the uncached in-process engine


@pytest.fixture(scope="module", params=["int8", "f16"])
def cached_stack(request, tmp_path_factory):
    metrics_port = free_ports(1)[0]
    s = Stack(tmp_path_factory.mktemp(f"prefix-{request.param}"), chunk=GATEWAY_CHUNK,
              worker_args=("--kv-dtype", request.param),
              prefill_args=("--metrics-port", str(metrics_port), "--prefix-cache-bytes", "64M"),
              gateway_args=("--chat-template", str(TEMPLATE)))
    s.metrics_port = metrics_port
    s.ref = Reference(chunk=GATEWAY_CHUNK, kv_dtype=request.param)
    yield s
    s.stop()


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in _tokens(seed, n)]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_report_cached_tokens_and_match_the_uncached_run(cached_stack, stream):
    s, c = cached_stack, cached_stack.client()
    shared = _ids(100 + stream, SHARED)
    for i, suffix in enumerate((_ids(200 + stream, 31), _ids(300 + stream, 57))):
        prompt = shared + suffix
        want = s.ref.text(s.ref.greedy(prompt, 12, ignore_eos=True))
        text, usage = greedy_completion(c, prompt, 12, stream)
        assert text == want
        assert usage.prompt_tokens == len(prompt)
        assert _cached(usage) == (0 if i == 0 else SHARED)  # 5 blocks of 200


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reports_cached_tokens_and_matches_the_uncached_run(cached_stack, stream):
    s, c = cached_stack, cached_stack.client()
    system = {"role": "system", "content": _words(400 + stream, 1300)}
    cached = []
    for question in ("w7 w8 w9?", "w10 w11 w12 w13?"):
        messages = [system, {"role": "user", "content": question}]
        ids = s.ref.chat_ids(messages)
        assert len(ids) > SHARED + GATEWAY_CHUNK
        want = s.ref.text(s.ref.greedy(ids, 10))
        kw = dict(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
        if stream:
            chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            usage = chunks[-1].usage
        else:
            r = c.chat.completions.create(**kw)
            text, usage = r.choices[0].message.content, r.usage
        assert text == want
        cached.append(_cached(usage))
    assert cached[0] == 0 and cached[1] >= SHARED and cached[1] % GATEWAY_CHUNK == 0


def test_n_choices_count_a_prompt_once(cached_stack):
    c = cached_stack.client()
    prompt = _ids(800, SHARED + 11)
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, n=2)
    # The two choices run one after the other in the worker, so the second may hit the first's blocks; the prompt
    # was computed once all the same.
    assert _cached(c.completions.create(**kw).usage) == 0
    assert _cached(c.completions.create(**kw).usage) == SHARED


def test_prefill_stats_and_metrics(cached_stack):
    s, c = cached_stack, cached_stack.client()
    prompt = _ids(500, 450)
    for _ in range(2):
        c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    stats = s.stats("prefill").prefix_cache
    assert stats.budget_bytes == 64 << 20 and stats.block_tokens == GATEWAY_CHUNK
    assert stats.hit_tokens >= 2 * GATEWAY_CHUNK and stats.queries >= 2
    assert stats.queried_tokens >= 2 * len(prompt) and stats.blocks >= 2 and 0 < stats.bytes <= stats.budget_bytes
    text = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).read().decode()
    samples = {smp.name: smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples}
    p = "splitgemma_prefill_prefix_cache_"
    stats = s.stats("prefill").prefix_cache  # no request in between: the same counters
    assert samples[p + "queries_total"] == stats.queries
    assert samples[p + "queried_tokens_total"] == stats.queried_tokens
    assert samples[p + "hit_tokens_total"] == stats.hit_tokens
    assert samples[p + "evictions_total"] == stats.evictions
    assert samples[p + "bytes"] == stats.bytes and samples[p + "blocks"] == stats.blocks
    assert samples[p + "budget_bytes"] == 64 << 20
    gateway = {smp.name: smp.value for fam in text_string_to_metric_families(
        urllib.request.urlopen(s.url + "/metrics", timeout=10).read().decode()) for smp in fam.samples}
    assert gateway["splitgemma_gateway_prompt_tokens_cached_total"] >= 2 * GATEWAY_CHUNK


def test_a_disabled_cache_reports_no_cached_tokens(tmp_path):
    s = Stack(tmp_path, chunk=GATEWAY_CHUNK, prefill_args=("--prefix-cache-bytes", "0"))
    try:
        prompt = _ids(600, SHARED + 20)
        for _ in range(2):
            r = s.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
            assert _cached(r.usage) == 0
        stats = s.stats("prefill").prefix_cache
        assert stats.budget_bytes == stats.blocks == stats.queries == 0
    finally:
        s.stop()


def test_prompts_sharing_a_first_block_go_to_the_same_prefill_worker(tmp_path):
    s = Stack(tmp_path, chunk=GATEWAY_CHUNK, n_prefill=2)
    try:
        c = s.client()
        for seed in range(700, 704):  # each prompt's twin must meet the worker that computed its first blocks
            shared = _ids(seed, 3 * GATEWAY_CHUNK)
            for i, suffix in enumerate((_ids(seed + 50, 9), _ids(seed + 60, 9))):
                r = c.completions.create(model=MODEL_NAME, prompt=shared + suffix, max_tokens=1, temperature=0)
                assert _cached(r.usage) == (0 if i == 0 else 3 * GATEWAY_CHUNK)
        hits = [s.stats(n).prefix_cache.hit_tokens for n in ("prefill", "prefill-2")]
        assert sum(hits) == 4 * 3 * GATEWAY_CHUNK
    finally:
        s.stop()
