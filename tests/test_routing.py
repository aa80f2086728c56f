"""Routing prompts over several prefill workers (services/gateway/routing.py): by the prefixes their caches hold, by
rendezvous hashing of the first block, by load, and around a worker that went down.

The rules alone on plain objects, then real processes: two prefill workers primed (straight through their gRPC API,
not the gateway) with different prefixes, each the prefix rendezvous hashing would have sent to the *other* worker,
so only the reported cache contents can send each request where its prefix is."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import pytest

from splitgemma.serving.prefix_keys import cacheable_keys, route_keys
from splitgemma.services.gateway import routing
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pbg
from test_gateway import CHUNK, MODEL_NAME, Reference, Stack
from test_kv_network import ids
from tools.procs import wait_decode_idle, wait_until


@dataclass(eq=False)
class W:
    address: str
    in_flight: int = 0
    prefixes: set = field(default_factory=set)


def test_route_keys_chain_the_whole_prefix():
    a, b = ids(1, 3 * CHUNK + 5), ids(2, CHUNK)
    ka = route_keys(a, CHUNK)
    assert len(ka) == 3 and route_keys(a[: 2 * CHUNK], CHUNK) == ka[:2]
    # The same second block after another first block has another key: a key names everything before it.
    assert route_keys(b + a[CHUNK:2 * CHUNK], CHUNK)[1] != ka[1]
    # A prefix cache never serves the last token: a prompt of exactly two blocks can hit only the first.
    assert cacheable_keys(a[: 2 * CHUNK], CHUNK) == ka[:1] and cacheable_keys(a[:CHUNK], CHUNK) == []


def test_pick_prefers_the_longest_cached_prefix_then_load():
    prompt = ids(3, 4 * CHUNK + 1)
    keys = cacheable_keys(prompt, CHUNK)
    one, two, three = W("a:1", prefixes=set(keys[:1])), W("b:1", prefixes=set(keys[:3])), W("c:1")
    assert routing.pick([one, two, three], keys, 0) == (two, "prefix")
    two.in_flight = routing.AFFINITY_SLACK  # still within the slack of the idle ones
    assert routing.pick([one, two, three], keys, 0) == (two, "prefix")
    two.in_flight = routing.AFFINITY_SLACK + 1  # overloaded: the next longest prefix
    assert routing.pick([one, two, three], keys, 0) == (one, "prefix")
    # A gap breaks the chain: holding blocks 2 and 3 but not 1 is holding nothing of this prompt.
    assert routing.held_blocks(set(keys[1:]), keys) == 0


def test_pick_without_a_cached_prefix_uses_rendezvous_then_load():
    workers = [W(f"10.0.0.{i}:50051") for i in range(4)]
    keys = cacheable_keys(ids(4, 2 * CHUNK + 1), CHUNK)
    owner, why = routing.pick(workers, keys, 0)
    assert why == "rendezvous" and owner is routing.rendezvous(workers, keys[0])
    # Taking another worker away moves nothing that worker did not own.
    rest = [w for w in workers if w is not owner][1:]
    assert routing.pick([owner, *rest], keys, 0)[0] is owner
    owner.in_flight = routing.AFFINITY_SLACK + 1
    w, why = routing.pick(workers, keys, 0)
    assert why == "load" and w is not owner and w.in_flight == 0
    # No full block: the least loaded, in turn.
    assert {routing.pick(workers, [], t)[0].address for t in range(3)} == {w.address for w in workers if w is not owner}


# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("routing"), n_prefill=2, prefill_args=("--prefix-cache-bytes", "64M"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref():
    return Reference()


def _prime(s, name: str, prompt: list[int]) -> None:
    """Run `prompt` on prefill worker `name` directly (Reserve → Prefill → Release), so its cache holds it."""
    decode = pbg.DecodeStub(s.channels["decode"])
    lease = decode.Reserve(pb.ReserveRequest(request_id=f"prime-{name}", prompt_tokens=len(prompt), max_tokens=1),
                           timeout=30)
    pbg.PrefillStub(s.channels[name]).Prefill(pb.PrefillRequest(request_id=f"prime-{name}", prompt_token_ids=prompt,
                                                                lease=lease), timeout=30)
    decode.Release(pb.ReleaseRequest(request_id=f"prime-{name}", lease=lease), timeout=30)


def _prefill_view(s) -> dict[str, dict]:
    workers = httpx.get(s.url + "/ready", timeout=10).json()["workers"]["prefill"]
    return {next(n for n, a in s.addresses.items() if a == w["address"]): w for w in workers}


def test_requests_land_where_their_prefix_is_cached(two, ref):
    s = two
    workers = [W(s.addresses["prefill"]), W(s.addresses["prefill-2"])]
    names = {id(workers[0]): "prefill", id(workers[1]): "prefill-2"}
    # For each worker, a prefix rendezvous hashing gives to the other one: primed on the one it does not own.
    primed = {}
    seed = 100
    while len(primed) < 2:
        prefix = ids(seed, 4 * CHUNK)
        seed += 1
        owner = names[id(routing.rendezvous(workers, route_keys(prefix, CHUNK)[0]))]
        target = "prefill-2" if owner == "prefill" else "prefill"
        if target not in primed:
            primed[target] = prefix
    for name, prefix in primed.items():
        _prime(s, name, prefix + ids(seed, 3))
    wait_until(lambda: all(w["prefix_blocks"] >= 4 for w in _prefill_view(s).values()),
               "the gateway knows both caches", 20)
    c = s.client()
    for name, prefix in primed.items():
        before = {n: s.stats(n).requests for n in ("prefill", "prefill-2")}
        prompt = prefix + ids(seed + 1, 11)
        r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text(ref.greedy(prompt, 4, ignore_eos=True))
        assert r.usage.prompt_tokens_details.cached_tokens == 4 * CHUNK
        after = {n: s.stats(n).requests for n in ("prefill", "prefill-2")}
        assert {n: after[n] - before[n] for n in after} == {n: int(n == name) for n in after}
    metrics = httpx.get(s.url + "/metrics", timeout=10).text
    assert 'splitgemma_gateway_prefill_routes_total{reason="prefix"} 2.0' in metrics
    wait_decode_idle(s.stats, 10)


def test_a_worker_that_goes_down_is_passed_over(two, ref):
    """Its prefix's requests go to the other worker (computing it), as correct as before; none fails."""
    s = two
    prefix = ids(900, 3 * CHUNK)
    _prime(s, "prefill", prefix + [5])
    wait_until(lambda: _prefill_view(s)["prefill"]["prefix_blocks"] >= 3, "the gateway knows the cache", 20)
    s.kill("prefill")
    c = s.client()
    before = s.stats("prefill-2").requests
    for i in range(3):
        prompt = prefix + ids(901 + i, 7)
        r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text(ref.greedy(prompt, 3, ignore_eos=True))
    assert s.stats("prefill-2").requests - before == 3
    deadline = time.monotonic() + 10
    while _prefill_view(s)["prefill"]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _prefill_view(s)["prefill"]["healthy"]
