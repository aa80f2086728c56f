"""The network KV transport (splitgemma/serving/kv_transport.py) between real processes. The decode worker `decode`
keeps its arena in a folder the prefill worker is not told about (its own --shm-dir), so the only way K/V can reach
its slots is Decode.PushKv; a second decode worker (`visible`) shares the prefill worker's folder, so its leases go
through shared memory. Everything runs with a service token, so the prefill worker must present it on PushKv.

Shown: greedy outputs through the gateway over the network equal the in-process engine (which the shared-memory
path equals: tests/test_gateway.py) token for token, and one prompt run over both transports gives the same events,
logprobs included; the choice of transport is per lease and reported; a forged, stale or malformed lease writes
nothing; a prefill killed mid-transfer leaves a half-written slot that Generate refuses, and the lease can still be
prefilled afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitgemma.engine import Model
from splitgemma.serving.shm_arena import open_shared_arena
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pbg
from test_gateway import (CHUNK, DECODE_WEIGHTS, MAX_CONTEXT, MODEL, MODEL_NAME, PREFILL_WEIGHTS, Reference, Stack,
                          collector, greedy_completion)  # noqa: F401 - collector: the module's OTLP receiver
from tools.procs import (DIE_WITH_PARENT, SPLITGEMMA, LoggedProcess, free_ports, grpc_serving, private_shm,
                         wait_decode_idle, wait_until)

TOKEN = "kv-network-test-token-0123456789"
BEARER = (("authorization", f"Bearer {TOKEN}"),)
RPC = 30


@pytest.fixture(scope="module")
def net(tmp_path_factory, collector):
    folder = tmp_path_factory.mktemp("kvnet")
    with private_shm("kvnet-hidden") as hidden:
        s = Stack(folder, env={"SPLITGEMMA_SERVICE_TOKEN": TOKEN, **collector.env()},
                  per_worker={"decode": ["--shm-dir", str(hidden)]})
        s.hidden = hidden
        (port,) = free_ports(1)
        s.visible_addr = f"127.0.0.1:{port}"
        s.procs["visible"] = LoggedProcess(
            [*SPLITGEMMA, "decode", "--model", MODEL, "--max-context", MAX_CONTEXT, "--chunk", CHUNK, "--threads", 1,
             "--shm-dir", s.shm, "--port", port, "--weights", DECODE_WEIGHTS, "--slots", 4,
             "--advertise-address", s.visible_addr],
            folder / "visible.log", env=s.env)
        try:
            s.channels["visible"] = grpc.insecure_channel(s.visible_addr)
            wait_until(lambda: grpc_serving(s.channels["visible"]), "visible decode worker", 60, watch=s.procs)
            yield s
        finally:
            s.stop()


@pytest.fixture(scope="module")
def ref():
    return Reference()


@pytest.fixture(scope="module")
def model():
    return Model(str(MODEL), threads=1, max_context=MAX_CONTEXT, chunk=CHUNK, max_batch=1, weights=PREFILL_WEIGHTS)


def decode_stub(s, name="decode") -> pbg.DecodeStub:
    return pbg.DecodeStub(s.channels[name])


def stats(s, name):
    stub = (pbg.DecodeStub if name in ("decode", "visible") else pbg.PrefillStub)(s.channels[name])
    return stub.Stats(pb.StatsRequest(), timeout=RPC, metadata=BEARER)


def reserve(s, name, rid, n, max_tokens=8) -> pb.Lease:
    lease = decode_stub(s, name).Reserve(pb.ReserveRequest(request_id=rid, prompt_tokens=n, max_tokens=max_tokens),
                                         timeout=RPC, metadata=BEARER)
    if name == "visible":  # started with --advertise-address: its leases say where to push
        assert lease.kv_address == s.visible_addr
    lease.kv_address = lease.kv_address or s.addresses[name]  # as the gateway fills it in
    return lease


def prefill(s, rid, prompt, lease) -> pb.PrefillResponse:
    return pbg.PrefillStub(s.channels["prefill"]).Prefill(
        pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, lease=lease,
                          sampling=pb.SamplingParams(temperature=0, logprobs=True, top_logprobs=3)),
        timeout=RPC, metadata=BEARER)


def generate(s, name, rid, lease, prompt, pre, max_tokens=8) -> list:
    return list(decode_stub(s, name).Generate(
        pb.GenerateRequest(request_id=rid, lease=lease, prompt_tokens=len(prompt), first_token=pre.first_token,
                           sampling=pb.SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
                           max_tokens=max_tokens, rng_state=pre.rng_state, ignore_eos=True),
        timeout=RPC, metadata=BEARER))


def code_of(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def ids(seed: int, n: int) -> list[int]:
    import random
    r = random.Random(seed)
    return [r.randrange(4, 1024) for _ in range(n)]


def slot_bytes(s, model, lease) -> bytes:
    """The leased slot's bytes, read from the hidden arena (the test may look where the prefill worker may not)."""
    view = open_shared_arena(model, lease.arena_path, lease.n_slots, lease.slot_bytes, str(s.hidden))
    try:
        return bytes(view.buf[lease.slot * lease.slot_bytes:(lease.slot + 1) * lease.slot_bytes])
    finally:
        view.locks.close()


def header(s, model, lease) -> dict:
    view = open_shared_arena(model, lease.arena_path, lease.n_slots, lease.slot_bytes, str(s.hidden))
    try:
        return view.arena.header(lease.slot)
    finally:
        view.locks.close()


def metric(url: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# ---------------------------------------------------------------------------------------------------------------
# In process: how a computed range is cut into parts


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_parts_of_a_range_rebuild_the_slot_exactly(kv_dtype):
    """A range sent as exports of sub-ranges (what a chunk larger than PART_BYTES becomes, e.g. E2B's 256 × 9,336
    bytes) leaves the receiving slot with the sender's checksum, across sliding-window rings; slicing one export's
    bytes would not (an export is packed layer by layer), which is why the sender exports sub-ranges."""
    from splitgemma.engine import open_arena
    from splitgemma.serving.kv_transport import export_parts
    m = Model(str(MODEL), threads=1, max_context=MAX_CONTEXT, chunk=CHUNK, max_batch=1, weights=PREFILL_WEIGHTS,
              kv_dtype=kv_dtype)
    per = m.kv_layout["position_bytes"]
    src, dst, sliced = open_arena(m, 1), open_arena(m, 1), open_arena(m, 1)
    prompt = ids(80, 5 * CHUNK + 7)
    for pos in range(0, len(prompt), CHUNK):
        end = min(len(prompt), pos + CHUNK)
        m.prefill(src, 0, prompt[pos:end], pos0=pos)
        parts = list(export_parts(src, 0, pos, end, part_bytes=5 * per))
        assert all(len(data) <= 5 * per for _, data in parts) and len(parts) > 1
        for p0, data in parts:
            dst.import_positions(0, p0, [data])
        whole = src.export_positions(0, pos, end)
        for off in range(0, end - pos, 5):  # the wrong way: one export's bytes cut by position count
            sliced.import_positions(0, pos + off, [whole[off * per:(off + 5) * per]])
    assert dst.n_tokens(0) == len(prompt) and dst.checksum(0) == src.checksum(0)
    assert sliced.n_tokens(0) == len(prompt) and sliced.checksum(0) != src.checksum(0)


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_through_the_gateway_over_the_network_equals_the_engine(net, ref, stream):
    """Every prompt's K/V reaches the hidden decode worker over PushKv; the text is the engine's, token for token,
    for prompts of one chunk, of many, and again with the prefix cache's blocks sent for the repeated prefix."""
    c = net.client()
    before = stats(net, "prefill")
    shared = ids(10 + stream, 5 * CHUNK)
    prompts = [ids(1 + stream, 7), ids(2 + stream, 3 * CHUNK + 5), shared + ids(3, 9), shared + ids(4, 21)]
    cached = []
    for prompt in prompts:
        text, usage = greedy_completion(c, prompt, 12, stream)
        assert text == ref.text(ref.greedy(prompt, 12, ignore_eos=True))
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached[-1] == 5 * CHUNK  # the repeated prefix came from the cache and went over the wire as blocks
    after = stats(net, "prefill")
    assert after.kv_network_prompts - before.kv_network_prompts == len(prompts)
    assert after.kv_shm_prompts == before.kv_shm_prompts
    tokens = after.kv_network_tokens - before.kv_network_tokens
    assert tokens == sum(map(len, prompts))
    # The bytes on the wire are the positions' K/V as export_positions packs them: position_bytes each, exactly.
    assert after.kv_wire_bytes - before.kv_wire_bytes == tokens * ref.prefill_model.kv_layout["position_bytes"]
    d = stats(net, "decode")
    assert d.kv_pushes_open == 0 and d.kv_push_bytes >= after.kv_wire_bytes - before.kv_wire_bytes
    assert metric(net.url + "/metrics", "splitgemma_gateway_kv_transport_total", transport="network") >= len(prompts)
    wait_decode_idle(lambda: stats(net, "decode"), 10)


def test_one_prompt_over_both_transports_gives_the_same_stream(net):
    """The choice is per lease: the visible worker's lease goes through shared memory, the hidden one's over the
    network; the first token, logprobs, checksum and every generated token agree."""
    prompt = ids(50, 4 * CHUNK + 17)
    runs = {}
    for name in ("visible", "decode"):
        rid = f"both-{name}"
        lease = reserve(net, name, rid, len(prompt))
        pre = prefill(net, rid, prompt, lease)
        runs[name] = (pre, generate(net, name, rid, lease, prompt, pre))
    (shm_pre, shm_events), (net_pre, net_events) = runs["visible"], runs["decode"]
    assert (shm_pre.kv_transport, shm_pre.kv_wire_bytes) == ("shm", 0)
    assert net_pre.kv_transport == "network" and net_pre.kv_wire_bytes > 0
    assert net_pre.first_token == shm_pre.first_token and net_pre.kv_checksum == shm_pre.kv_checksum
    assert [list(e.tokens) for e in net_events] == [list(e.tokens) for e in shm_events]
    assert len([t for e in net_events for t in e.tokens]) == 8


def test_a_forged_stale_or_malformed_lease_writes_nothing(net, model):
    prompt = ids(60, 2 * CHUNK + 3)
    lease = reserve(net, "decode", "forged", len(prompt))
    before, pushed = slot_bytes(net, model, lease), stats(net, "decode").kv_push_bytes
    forged = pb.Lease()
    forged.CopyFrom(lease)
    forged.secret = bytes(32) if lease.secret != bytes(32) else b"\x01" * 32
    code, details = code_of(lambda: prefill(net, "forged", prompt, forged))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "nothing was written" in details
    short = pb.Lease()
    short.CopyFrom(lease)
    short.secret = lease.secret[:16]
    assert code_of(lambda: prefill(net, "forged", prompt, short))[0] == grpc.StatusCode.INVALID_ARGUMENT
    # A push straight to the decode worker with the forged lease is refused before any part is read.
    parts = iter([pb.KvPush(open=pb.KvPushOpen(request_id="forged", lease=forged, prompt_tokens=len(prompt))),
                  pb.KvPush(positions=pb.KvPositions(pos0=0, data=bytes(model.kv_layout["position_bytes"])))])
    code, _ = code_of(lambda: list(decode_stub(net).PushKv(parts, timeout=RPC, metadata=BEARER)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert slot_bytes(net, model, lease) == before
    # Stale: the lease was given back; its generation no longer matches the slot's stamp.
    decode_stub(net).Release(pb.ReleaseRequest(request_id="forged", lease=lease), timeout=RPC, metadata=BEARER)
    before = slot_bytes(net, model, lease)  # the release cleared the header's lease stamp
    code, details = code_of(lambda: prefill(net, "forged", prompt, lease))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "nothing was written" in details
    assert slot_bytes(net, model, lease) == before
    assert stats(net, "decode").kv_push_bytes == pushed
    wait_decode_idle(lambda: stats(net, "decode"), 10)


# A prefill worker that dies mid-transfer: it computes the prompt's first chunk with the engine, streams it with the
# project's KvSender, says so, and waits to be SIGKILLed.
_DYING_PREFILL = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    from splitgemma.engine import Model, open_arena
    from splitgemma.serving.kv_transport import KvChannels, KvSender
    from splitgemma.v1 import serving_pb2 as pb
    model_path, ctx, chunk, weights, token, lease_hex, prompt = sys.argv[1:8]
    lease = pb.Lease.FromString(bytes.fromhex(lease_hex))
    tokens = np.array(list(map(int, prompt.split(","))), dtype=np.int64)
    model = Model(model_path, threads=1, max_context=int(ctx), chunk=int(chunk), max_batch=1, weights=weights)
    arena = open_arena(model, 1)
    n = int(chunk)
    model.prefill(arena, 0, tokens[:n])
    async def main():
        channels = KvChannels(token, None)
        sender = KvSender(channels.stub(lease.kv_address), "dying", lease, len(tokens), timeout=60)
        await sender.open()
        sender.send(0, arena.export_positions(0, 0, n))
        while sender.wire_bytes < n * model.kv_layout["position_bytes"]:
            await asyncio.sleep(0.01)
        print("sent", flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


def test_a_prefill_killed_mid_transfer_leaves_no_admitted_slot(net, model, ref, tmp_path):
    prompt = ids(70, 3 * CHUNK + 9)
    lease = reserve(net, "decode", "dying", len(prompt), max_tokens=6)
    dying = subprocess.Popen([*DIE_WITH_PARENT, sys.executable, "-c", _DYING_PREFILL, str(MODEL), str(MAX_CONTEXT),
                              str(CHUNK), PREFILL_WEIGHTS, TOKEN, lease.SerializeToString().hex(),
                              ",".join(map(str, prompt))],
                             stdout=subprocess.PIPE, stderr=open(tmp_path / "dying.log", "wb"), env=net.env)
    try:
        assert dying.stdout.readline().strip() == b"sent", (tmp_path / "dying.log").read_text()
        wait_until(lambda: header(net, model, lease)["n_tokens"] == CHUNK, "the first chunk written", 20)
        assert stats(net, "decode").kv_pushes_open == 1
    finally:
        dying.send_signal(signal.SIGKILL)
        dying.wait(10)
    wait_until(lambda: stats(net, "decode").kv_pushes_open == 0, "the broken stream noticed", 20)
    h = header(net, model, lease)
    assert h["n_tokens"] == CHUNK and not h["sealed"]  # half written, and not sealed
    # The lease is alive and its slot unsealed: a Generate now would be refused. The gateway's retry (another
    # Prefill of the same lease) writes the whole prompt, and the stream is the engine's.
    pre = prefill(net, "dying", prompt, lease)
    assert pre.kv_transport == "network"
    events = generate(net, "decode", "dying", lease, prompt, pre, max_tokens=6)
    assert [t.token_id for e in events for t in e.tokens] == ref.greedy(prompt, 6, ignore_eos=True)
    wait_decode_idle(lambda: stats(net, "decode"), 10)
    # Killed again, and this time Generate comes before any retry: refused, the half-written slot is not admitted.
    lease = reserve(net, "decode", "dying-2", len(prompt), max_tokens=6)
    dying = subprocess.Popen([*DIE_WITH_PARENT, sys.executable, "-c", _DYING_PREFILL.replace('"dying"', '"dying-2"'),
                              str(MODEL), str(MAX_CONTEXT), str(CHUNK), PREFILL_WEIGHTS, TOKEN,
                              lease.SerializeToString().hex(), ",".join(map(str, prompt))],
                             stdout=subprocess.PIPE, stderr=open(tmp_path / "dying-2.log", "wb"), env=net.env)
    try:
        assert dying.stdout.readline().strip() == b"sent", (tmp_path / "dying-2.log").read_text()
    finally:
        dying.send_signal(signal.SIGKILL)
        dying.wait(10)
    wait_until(lambda: stats(net, "decode").kv_pushes_open == 0, "the broken stream noticed", 20)
    code, details = code_of(lambda: generate(net, "decode", "dying-2", lease, prompt, pre))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "KV handoff refused" in details
    wait_decode_idle(lambda: stats(net, "decode"), 10)


def test_the_trace_shows_the_transport(net, collector, model):
    """One trace across the three processes: the prefill span says network and its bytes, and the decode worker's
    PushKv is a span of the same trace, sealed."""
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    c = net.client(default_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    prompt = ids(90, 2 * CHUNK + 1)
    wire = len(prompt) * model.kv_layout["position_bytes"]
    c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)

    def spans():
        got = {(sp["service"], sp["name"]): sp for sp in collector.trace(trace_id)}
        return got if {("splitgemma-prefill", "prefill.forward"), ("splitgemma-decode", "decode.kv_push")} <= \
            set(got) else None

    wait_until(lambda: spans() is not None, "the spans of the request", 20)
    got = spans()
    forward = got[("splitgemma-prefill", "prefill.forward")]["attributes"]
    assert forward["splitgemma.kv.transport"] == "network"
    assert forward["splitgemma.kv.wire_bytes"] == wire
    push = got[("splitgemma-decode", "decode.kv_push")]["attributes"]
    assert push["splitgemma.kv.outcome"] == "sealed" and push["splitgemma.kv.wire_bytes"] == wire


def test_decode_metrics_and_log(net):
    """Stats and the prefill worker's log say which transport each prompt took."""
    log = net.log("prefill")
    assert '"kv_transport": "network"' in log and '"kv_transport": "shm"' in log
    d = stats(net, "decode")
    assert d.kv_pushes_sealed >= 1 and d.kv_pushes_refused >= 2  # the forged push and the killed ones
