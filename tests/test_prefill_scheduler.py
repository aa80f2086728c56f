"""The prefill worker's scheduler (services/prefill/scheduler.py) with real worker processes and gRPC stubs: several
prompts in flight on one model thread, chunks interleaved by --prefill-policy, results bit-identical to solo runs,
cancellation, the in-flight bound, the slot's writer lock held from acceptance, and the bounds that replace the
lease deadline. Nothing here depends on the machine's speed: where a prompt must be waiting, this test holds its
slot's writer lock (or stops the decode worker); orderings are read from the worker's own chunk counter."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from splitgemma.engine import Model
from splitgemma.serving.shm_arena import SlotLocks, open_shared_arena, request_key
from splitgemma.v1 import serving_pb2 as pb
from test_workers import FGM, RPC_TIMEOUT, Client, Worker, _metrics, prompt_of, seeded, status_of
from tools.procs import free_ports, private_shm, wait_until

CTX, CHUNK = 4096, 32
LONG = 4000  # 125 chunks
HANG_GUARD = 120  # seconds: only a hang reaches it


def greedy() -> pb.SamplingParams:
    """Greedy with a seed: the returned sampler state is then the seed, so runs compare equal."""
    return pb.SamplingParams(temperature=0, seed=1, logprobs=True)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """One decode worker and four prefill workers on its arena: rr, srf (the default flags), fifo, and a tight one
    (2 prompts in flight, 3 s per prompt, metrics on)."""
    logs = tmp_path_factory.mktemp("sched")
    with private_shm("sched") as shm:
        geometry = ["--model", str(FGM), "--max-context", str(CTX), "--chunk", str(CHUNK), "--shm-dir", str(shm)]
        d = Worker("decode", [*geometry, "--slots", "8", "--lease-ms", "60000"], logs / "decode.log")
        (metrics,) = free_ports(1)
        flags = {"rr": ["--prefill-policy", "rr"], "srf": [], "fifo": ["--prefill-policy", "fifo"],
                 "tight": ["--max-prompts", "2", "--max-prefill-seconds", "3", "--metrics-port", str(metrics)]}
        # The prefix cache is off: these tests run a prompt solo and then again, and the second run must compute
        # every chunk, not restore them (tests/test_prefix_cache.py covers the cache).
        prefill = {name: Worker("prefill", [*geometry, "--prefix-cache-bytes", "0", *f], logs / f"prefill-{name}.log")
                   for name, f in flags.items()}
        try:
            d.wait_ready()
            clients = {name: Client(d, p.wait_ready()) for name, p in prefill.items()}
            clients["tight"].metrics_ports = {"prefill": metrics}
            yield clients
        finally:
            d.stop()
            for p in prefill.values():
                p.stop()


def prefill_stats(c: Client) -> pb.PrefillStats:
    return c.prefill.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT)


def wait_counts(c: Client, waiting: int, running: int) -> None:
    wait_until(lambda: (lambda s: (s.prompts_waiting, s.prompts_running) == (waiting, running))(prefill_stats(c)),
               f"{waiting} prompts waiting and {running} running", HANG_GUARD, interval=0.01)


def release(c: Client, rid: str, lease: pb.Lease) -> None:
    c.decode.Release(pb.ReleaseRequest(request_id=rid, lease=lease), timeout=RPC_TIMEOUT)


def solo(c: Client, rid: str, prompt, sampling: pb.SamplingParams) -> pb.PrefillResponse:
    """A prefill with nothing else in flight (its slot is given back)."""
    assert prefill_stats(c).prompts_waiting == prefill_stats(c).prompts_running == 0
    lease = c.reserve(rid, len(prompt))
    try:
        return c.prefill.Prefill(c.prefill_req(rid, prompt, lease, sampling), timeout=HANG_GUARD)
    finally:
        release(c, rid, lease)


def same_result(a: pb.PrefillResponse, b: pb.PrefillResponse) -> bool:
    return (a.first_token, a.rng_state, a.kv_checksum, a.prompt_tokens) == \
        (b.first_token, b.rng_state, b.kv_checksum, b.prompt_tokens)


class SlotHeld:
    """This test holds a leased slot's writer lock (as another writer would), so a Prefill of it must wait."""

    def __init__(self, lease: pb.Lease):
        self.locks = SlotLocks(os.open(lease.arena_path, os.O_RDWR), lease.slot_bytes)
        self.slot = lease.slot
        assert self.locks.try_lock(self.slot)

    def let_go(self) -> None:
        if self.locks is not None:
            self.locks.unlock(self.slot)
            self.locks.close()
            self.locks = None


@pytest.fixture(scope="module")
def slot_of():
    """slot_of(lease) -> (header, bytes): the leased slot as the decode worker's arena holds it, read through this
    test's own mapping."""
    m = Model(str(FGM), threads=1, max_context=CTX, chunk=CHUNK, max_batch=1)

    def read(lease: pb.Lease) -> tuple[dict, bytes]:
        view = open_shared_arena(m, lease.arena_path, lease.n_slots, lease.slot_bytes,
                                 os.path.dirname(lease.arena_path))
        start = lease.slot * lease.slot_bytes
        return view.arena.header(lease.slot), bytes(view.buf[start:start + lease.slot_bytes])

    return read


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["rr", "srf", "fifo"])
def test_a_short_prompt_behind_a_long_one(workers, policy):
    """The short prompt is sent once the worker says the long one is running (its first chunk of 125 is in). Under
    rr and srf the short prompt is sealed (its first token) long before the long one; fifo, the old one-at-a-time
    order, is the contrast. Both results equal solo runs."""
    c = workers[policy]
    long_p, short_p = prompt_of(101, LONG), prompt_of(102, 20)
    want_long, want_short = solo(c, "ord-solo-l", long_p, greedy()), solo(c, "ord-solo-s", short_p, greedy())
    leases = {"l": c.reserve("ord-l", LONG), "s": c.reserve("ord-s", 20)}
    try:
        fut_l = c.prefill.Prefill.future(c.prefill_req("ord-l", long_p, leases["l"], greedy()), timeout=HANG_GUARD)
        wait_counts(c, 0, 1)
        got_s = c.prefill.Prefill(c.prefill_req("ord-s", short_p, leases["s"], greedy()), timeout=HANG_GUARD)
        got_l = fut_l.result(HANG_GUARD)
    finally:
        for rid, lease in leases.items():
            release(c, f"ord-{rid}", lease)
    assert same_result(got_l, want_long) and same_result(got_s, want_short)
    assert got_l.first_chunk_step < got_s.first_chunk_step  # the long prompt was running first
    if policy == "fifo":
        assert got_s.first_chunk_step > got_l.last_chunk_step  # the short one waited for the whole long one
    else:
        # The short one's first token came first: its one chunk ran between two of the long one's. (This needs the
        # short call to arrive before the long one's other 124 chunks have run: one RPC against 124 passes.)
        assert got_s.last_chunk_step < got_l.last_chunk_step
        assert got_l.last_chunk_step - got_l.first_chunk_step == LONG // CHUNK
    c.wait_idle()


@pytest.mark.parametrize("policy", ["rr", "srf"])
def test_a_prompt_of_a_worse_priority_waits(workers, policy):
    """As the test above, but the short prompt has priority 5 against the long one's 0 (lower first): under either
    interleaving policy it waits for the whole long prompt, and its result is still its solo run's."""
    c = workers[policy]
    long_p, short_p = prompt_of(103, LONG), prompt_of(104, 20)
    want_short = solo(c, "pri-solo-s", short_p, greedy())
    leases = {"l": c.reserve("pri-l", LONG), "s": c.reserve("pri-s", 20)}
    try:
        fut_l = c.prefill.Prefill.future(c.prefill_req("pri-l", long_p, leases["l"], greedy()), timeout=HANG_GUARD)
        wait_counts(c, 0, 1)
        short = c.prefill_req("pri-s", short_p, leases["s"], greedy())
        short.priority = 5
        got_s = c.prefill.Prefill(short, timeout=HANG_GUARD)
        got_l = fut_l.result(HANG_GUARD)
    finally:
        for rid, lease in leases.items():
            release(c, f"pri-{rid}", lease)
    assert same_result(got_s, want_short)
    assert got_s.first_chunk_step > got_l.last_chunk_step
    c.wait_idle()


def test_concurrent_results_equal_solo_runs(workers):
    """Six prompts of mixed lengths (some not a multiple of the chunk) with seeded sampling, in flight together on
    the rr worker: each one's first token, logprobs, sampler state and slot K/V checksum equal its solo run's."""
    c = workers["rr"]
    lengths = [700, 33, 1, 300, 64, 129]
    prompts = [prompt_of(200 + i, n) for i, n in enumerate(lengths)]
    sampling = [seeded(7 + i, top_k=40, top=3) for i in range(len(prompts))]
    want = [solo(c, f"eq-solo-{i}", p, s) for i, (p, s) in enumerate(zip(prompts, sampling))]
    leases = [c.reserve(f"eq-{i}", len(p)) for i, p in enumerate(prompts)]
    try:
        futures = [c.prefill.Prefill.future(c.prefill_req(f"eq-{i}", p, lease, s), timeout=HANG_GUARD)
                   for i, (p, lease, s) in enumerate(zip(prompts, leases, sampling))]
        got = [f.result(HANG_GUARD) for f in futures]
    finally:
        for i, lease in enumerate(leases):
            release(c, f"eq-{i}", lease)
    for g, w in zip(got, want):
        assert same_result(g, w)
        assert g.first_token.top_logprobs == w.first_token.top_logprobs
    # Interleaved: some prompt started before another one's last chunk.
    assert any(a.first_chunk_step < b.last_chunk_step and b.first_chunk_step < a.last_chunk_step
               for a in got for b in got if a is not b)
    c.wait_idle()


def test_cancelling_a_waiting_prompt_leaves_the_others(workers, slot_of):
    """A call waiting for its slot (this test holds the lock) is cancelled while two others run: it ends CANCELLED,
    its slot stays untouched (so unsealed for it), its place in flight is given back, and the others equal solo runs."""
    c = workers["rr"]
    prompts = {"a": prompt_of(301, 500), "x": prompt_of(302, 300), "b": prompt_of(303, 40)}
    want = {k: solo(c, f"cx-solo-{k}", p, greedy()) for k, p in prompts.items()}
    leases = {k: c.reserve(f"cx-{k}", len(p)) for k, p in prompts.items()}
    held = SlotHeld(leases["x"])
    before = slot_of(leases["x"])
    try:
        fut = {k: c.prefill.Prefill.future(c.prefill_req(f"cx-{k}", prompts[k], leases[k], greedy()),
                                           timeout=HANG_GUARD) for k in ("x", "a", "b")}
        wait_until(lambda: prefill_stats(c).prompts_waiting >= 1, "the call for x", HANG_GUARD)
        fut["x"].cancel()
        got = {k: fut[k].result(HANG_GUARD) for k in ("a", "b")}
        wait_counts(c, 0, 0)  # x's call is gone too (it cannot have run: its slot is still locked here)
        held.let_go()
        assert slot_of(leases["x"]) == before  # not a byte written (a slot's header keeps its last seal)
    finally:
        held.let_go()
        for k, lease in leases.items():
            release(c, f"cx-{k}", lease)
    assert fut["x"].cancelled()
    for k in ("a", "b"):
        assert same_result(got[k], want[k])
    c.wait_idle()


def test_more_prompts_than_the_bound_are_refused(workers):
    """With --max-prompts 2 and two calls in flight (waiting for their slots, whose locks this test holds), a third
    call is refused with RESOURCE_EXHAUSTED and a retry-after hint; the two then run. The gauges and the queue-time
    histogram say the same."""
    c = workers["tight"]
    leases = [c.reserve(f"cap-{i}", 16) for i in range(3)]
    held = [SlotHeld(lease) for lease in leases[:2]]
    try:
        futures = [c.prefill.Prefill.future(c.prefill_req(f"cap-{i}", prompt_of(500 + i, 16), leases[i], greedy()),
                                            timeout=HANG_GUARD) for i in range(2)]
        wait_counts(c, 2, 0)
        values = _metrics(c.metrics_ports["prefill"])
        assert values['splitgemma_prefill_prompts{state="waiting"}'] == 2
        assert values['splitgemma_prefill_prompts{state="running"}'] == 0
        with pytest.raises(grpc.RpcError) as e:
            c.prefill.Prefill(c.prefill_req("cap-2", prompt_of(502, 16), leases[2], greedy()), timeout=RPC_TIMEOUT)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 prompts in flight" in e.value.details()
        assert ("retry-after-ms", "1000") in tuple(e.value.trailing_metadata())
        for h in held:
            h.let_go()
        assert all(f.result(HANG_GUARD).prompt_tokens == 16 for f in futures)
    finally:
        for h in held:
            h.let_go()
        for i, lease in enumerate(leases):
            release(c, f"cap-{i}", lease)
    stats = prefill_stats(c)
    assert (stats.prompts_waiting, stats.prompts_running, stats.max_prompts) == (0, 0, 2)
    assert stats.prefill_policy == "srf" and stats.queued_seconds > 0  # the default
    values = _metrics(c.metrics_ports["prefill"])
    assert values["splitgemma_prefill_queued_seconds_count"] >= 2
    c.wait_idle()


def test_a_waiting_prompt_outlives_its_lease_deadline(workers, slot_of):
    """The lease deadline is checked on arrival only: a call accepted before it and still waiting after it (this test
    holds the slot lock; the decode worker is stopped meanwhile, so it cannot take the slot back) is sealed. The
    worker's own bound is the call's deadline: a call still waiting when that passes ends without writing."""
    c = workers["rr"]
    lease = c.reserve("late", 16, lease_ms=1500)
    held = SlotHeld(lease)
    decode = c.decode_worker.proc
    try:
        fut = c.prefill.Prefill.future(c.prefill_req("late", prompt_of(601, 16), lease, greedy()), timeout=HANG_GUARD)
        wait_counts(c, 1, 0)
        decode.send_signal(signal.SIGSTOP)
        wait_until(lambda: time.time() * 1000 > lease.deadline_unix_ms + 100, "the lease deadline", HANG_GUARD)
        held.let_go()
        got = fut.result(HANG_GUARD)
        h, _ = slot_of(lease)
        assert h["sealed"] and h["request_id"] == request_key("late") and h["checksum"] == got.kv_checksum
    finally:
        held.let_go()
        decode.send_signal(signal.SIGCONT)
    c.wait_idle()  # the decode worker expired the unclaimed lease once it ran again

    lease = c.reserve("short-deadline", 16)
    held = SlotHeld(lease)
    before = slot_of(lease)
    try:
        code, _ = status_of(lambda: c.prefill.Prefill(c.prefill_req("short-deadline", prompt_of(602, 16), lease,
                                                                    greedy()), timeout=0.5))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_counts(c, 0, 0)  # the worker let the call go
    finally:
        held.let_go()
    assert slot_of(lease) == before
    release(c, "short-deadline", lease)
    c.wait_idle()


def test_the_worker_bounds_a_call_without_a_deadline(workers):
    """--max-prefill-seconds 3: a call with no deadline of its own that still waits for its slot after 3 s ends
    DEADLINE_EXCEEDED, naming the limit, and writes nothing."""
    c = workers["tight"]
    lease = c.reserve("no-deadline", 16)
    held = SlotHeld(lease)
    try:
        code, msg = status_of(lambda: c.prefill.Prefill(c.prefill_req("no-deadline", prompt_of(701, 16), lease,
                                                                      greedy()), timeout=HANG_GUARD))
    finally:
        held.let_go()
        release(c, "no-deadline", lease)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "--max-prefill-seconds" in msg and "nothing was written" in msg
    c.wait_idle()
