"""Admission (services/decode/admission.py, docs/scheduling.md): the decode worker's first-come-first-served queue
of Reserve calls, driven through the gateway with the official openai client over real processes.

Arrival order is made certain without timing: request i is sent only once the decode worker's Stats show the
i before it waiting. The slots are held by leases this test takes itself (gRPC Reserve), so nothing frees a slot
until the test says so; the order in which the queued requests then got their leases is read from the decode
worker's log ("reserved" lines, written as leases are granted).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from splitgemma.serving.shm_arena import SlotLocks
from splitgemma.services.decode.admission import RETRY_MIN_S, Admission, DrainEstimate
from splitgemma.services.decode.slots import SlotTable
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pbg
from test_gateway import MODEL_NAME, Stack
from tools.procs import free_ports, wait_until

SLOTS = 4
HANG_GUARD = 60  # seconds: only so that a bug fails instead of hanging


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    (metrics_port,) = free_ports(1)
    s = Stack(tmp_path_factory.mktemp("admission"), slots=SLOTS, decode_args=("--metrics-port", str(metrics_port)))
    s.decode_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    yield s
    assert s.stop() == []


def _hold(stack, n: int, tag: str) -> list[tuple[str, pb.Lease]]:
    """Take n slots with leases nobody will use (long enough not to expire during the test)."""
    out = []
    for i in range(n):
        rid = f"hold-{tag}-{i}"
        out.append((rid, stack.decode.Reserve(pb.ReserveRequest(request_id=rid, prompt_tokens=4, max_tokens=4,
                                                                lease_ms=600_000), timeout=HANG_GUARD)))
    return out


def _release(stack, held) -> None:
    for rid, lease in held:
        stack.decode.Release(pb.ReleaseRequest(request_id=rid, lease=lease), timeout=HANG_GUARD)


def _queued(stack) -> int:
    return stack.stats().admission.queued


def _wait_queued(stack, n: int) -> None:
    wait_until(lambda: _queued(stack) == n, f"{n} Reserve calls queued", HANG_GUARD)


def _metric(url: str, name: str) -> float:
    """One sample (name with its labels, as Prometheus writes it) from a /metrics page."""
    for line in httpx.get(url, timeout=HANG_GUARD).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}")


def _gateway_metric(stack, name: str) -> float:
    return _metric(stack.url + "/metrics", name)


def _granted(stack, prefix: str) -> list[str]:
    """Request ids of the leases the decode worker granted, in the order it granted them."""
    out = []
    for line in stack.log("decode").splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("msg") == "reserved" and rec["request_id"].startswith(prefix):
                out.append(rec["request_id"])
    return out


def _complete(client: openai.OpenAI, rid: str, **kw):
    return client.completions.create(model=MODEL_NAME, prompt="w5 w6 w7", max_tokens=2, temperature=0,
                                     extra_headers={"X-Request-Id": rid}, **kw)


def test_three_times_the_slots_all_succeed_in_arrival_order(stack):
    stack.wait_idle()
    held = _hold(stack, SLOTS, "fifo")
    client = stack.client()
    n = 3 * SLOTS
    waits = 'splitgemma_decode_queue_wait_seconds_count{outcome="granted"}'
    granted_before = _metric(stack.decode_metrics, waits)
    with ThreadPoolExecutor(n) as ex:
        try:
            futures = []
            for i in range(n):
                futures.append(ex.submit(_complete, client, f"fifo-{i}"))
                _wait_queued(stack, i + 1)
            # The gateway counts exactly the requests that wait (none has a lease yet).
            assert _gateway_metric(stack, "splitgemma_gateway_requests_waiting") == n
            assert _metric(stack.decode_metrics, "splitgemma_decode_queue_depth") == n
            assert not any(f.done() for f in futures)
        finally:
            _release(stack, held)
        results = [f.result(HANG_GUARD) for f in futures]
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2 for r in results)
    assert _granted(stack, "fifo-") == [f"fifo-{i}-0" for i in range(n)]
    a = stack.wait_idle().admission
    assert a.queued == 0 and a.queued_total >= n and a.slots_freed_per_second > 0
    assert _gateway_metric(stack, "splitgemma_gateway_requests_waiting") == 0
    assert _metric(stack.decode_metrics, "splitgemma_decode_queue_depth") == 0
    assert _metric(stack.decode_metrics, waits) == granted_before + n


def test_priority_orders_the_waiting_requests(tmp_path):
    """Under --scheduling-policy priority the gateway passes each request's priority on: three requests queued while
    every slot is held, sent as priority 0, 5, -1, get their slots as -1, 0, 5. Under the default policy (fcfs) a
    priority other than 0 is refused by name."""
    s = Stack(tmp_path, slots=SLOTS, gateway_args=("--scheduling-policy", "priority"))
    try:
        held = _hold(s, SLOTS, "pri")
        client = s.client()
        with ThreadPoolExecutor(3) as ex:
            try:
                futures = []
                for i, (rid, priority) in enumerate((("pri-late", 0), ("pri-batch", 5), ("pri-urgent", -1))):
                    futures.append(ex.submit(_complete, client, rid, extra_body={"priority": priority}))
                    _wait_queued(s, i + 1)
            finally:
                _release(s, held)
            assert all(f.result(HANG_GUARD).usage.completion_tokens == 2 for f in futures)
        assert _granted(s, "pri-") == ["pri-urgent-0", "pri-late-0", "pri-batch-0"]
    finally:
        assert s.stop() == []


def test_priority_needs_the_priority_policy(stack):
    with pytest.raises(openai.BadRequestError) as e:
        _complete(stack.client(), "fcfs-priority", extra_body={"priority": 1})
    assert e.value.body["param"] == "priority"
    assert _complete(stack.client(), "fcfs-priority-0", extra_body={"priority": 0}).usage.completion_tokens == 2


def test_requests_with_n_choices_get_their_slots_together(stack):
    """Two requests of n = 3 on four slots, queued while every slot is held: taken one by one, each could hold some
    slots and wait for the rest, both running out the queue timeout. As groups, the first gets three slots at once,
    the second waits (the one free slot is not enough) until the first is done, and both are answered."""
    stack.wait_idle()
    held = _hold(stack, SLOTS, "group")
    client = stack.client()
    with ThreadPoolExecutor(2) as ex:
        try:
            first = ex.submit(_complete, client, "group-a", n=3)
            _wait_queued(stack, 1)
            second = ex.submit(_complete, client, "group-b", n=3)
            _wait_queued(stack, 2)
        finally:
            _release(stack, held)
        results = [first.result(HANG_GUARD), second.result(HANG_GUARD)]
    assert all(len(r.choices) == 3 for r in results)
    assert _granted(stack, "group-") == [f"group-{x}-{i}" for x in "ab" for i in range(3)]
    assert stack.wait_idle().admission.queued == 0


def _raw_request(port: int, rid: str) -> socket.socket:
    """A completion request on a raw connection, so that the test decides when the client goes away."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "w5", "max_tokens": 2}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"X-Request-Id: " + rid.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    return sock


def test_a_queued_client_that_disconnects_gives_its_place_to_the_next(stack):
    stack.wait_idle()
    held = _hold(stack, SLOTS, "gone")
    before = stack.stats().admission
    client = stack.client()
    with ThreadPoolExecutor(1) as ex:
        try:
            gone = _raw_request(stack.port, "gone")
            _wait_queued(stack, 1)
            after = ex.submit(_complete, client, "gone-next")
            _wait_queued(stack, 2)
            gone.close()  # the head of the queue goes away: the gateway cancels its Reserve
            wait_until(lambda: stack.stats().admission.cancelled == before.cancelled + 1, "the cancel", HANG_GUARD)
            assert _queued(stack) == 1
            assert _gateway_metric(stack, "splitgemma_gateway_requests_waiting") == 1
            _release(stack, held[:1])  # one slot frees: it goes to the one left waiting
            assert after.result(HANG_GUARD).usage.completion_tokens == 2
        finally:
            _release(stack, held[1:])
    assert _granted(stack, "gone") == ["gone-next-0"]
    stack.wait_idle()


def test_with_every_slot_busy_the_gateway_queues_at_the_shortest_queue(tmp_path):
    s = Stack(tmp_path, slots=1, n_decode=2)
    try:
        names = ("decode", "decode-2")
        leases = {}
        for n in names:  # both slots taken
            stub = pbg.DecodeStub(s.channels[n])
            leases[n] = (stub, stub.Reserve(pb.ReserveRequest(request_id=f"hold-{n}", prompt_tokens=4,
                                                              lease_ms=600_000), timeout=HANG_GUARD))

        def gateway_sees_both_full():
            workers = httpx.get(s.url + "/ready", timeout=HANG_GUARD).json()["workers"]["decode"]
            return all(w.get("slots_leased") == 1 for w in workers)

        wait_until(gateway_sees_both_full, "the gateway to see both slots taken", HANG_GUARD)
        client = s.client()

        def queued() -> list[int]:
            return [s.stats(n).admission.queued for n in names]

        with ThreadPoolExecutor(2) as ex:
            first = ex.submit(_complete, client, "route-1")
            wait_until(lambda: sum(queued()) == 1, "the first request to queue", HANG_GUARD)
            second = ex.submit(_complete, client, "route-2")
            wait_until(lambda: sum(queued()) == 2, "the second request to queue", HANG_GUARD)
            assert queued() == [1, 1]  # not behind the first
            for n, (stub, lease) in leases.items():
                stub.Release(pb.ReleaseRequest(request_id=f"hold-{n}", lease=lease), timeout=HANG_GUARD)
            assert first.result(HANG_GUARD).usage.completion_tokens == 2
            assert second.result(HANG_GUARD).usage.completion_tokens == 2
    finally:
        s.stop()


def test_queue_limits_retry_after_lease_extension_and_drain(tmp_path):
    """One slot, a queue of one, two seconds of patience: a full queue is 429, a wait past the timeout is 503, both
    with Retry-After; more choices than there are slots take none; a lease whose slot a prefill is writing does
    not expire; a draining worker answers its queue UNAVAILABLE."""
    s = Stack(tmp_path, slots=1, decode_args=("--max-queue", "1", "--queue-timeout", "2"))
    try:
        client = s.client()
        held = _hold(s, 1, "limit")
        with ThreadPoolExecutor(1) as ex:
            waiting = ex.submit(_complete, client, "limit-wait")
            _wait_queued(s, 1)
            with pytest.raises(openai.RateLimitError) as full:
                _complete(client, "limit-full")
            with pytest.raises(openai.InternalServerError) as late:
                waiting.result(HANG_GUARD)
        assert full.value.status_code == 429 and full.value.code == "queue_full"
        assert late.value.status_code == 503 and late.value.code == "queue_timeout"
        # Nothing freed a slot yet: the hint for the timeout is the queue timeout (that long brought no slot); for the
        # full queue the shortest, 1 s (nothing is measured to say more).
        assert late.value.response.headers["Retry-After"] == "2"
        assert full.value.response.headers["Retry-After"] == "1"
        a = s.stats().admission
        assert (a.queued, a.refused_queue_full, a.refused_timeout) == (0, 1, 1)
        _release(s, held)

        # n=2 on one slot could only wait out the queue timeout while its first choice holds the slot: it is refused
        # at once, before any slot is taken.
        expired = s.wait_idle().leases_expired
        with pytest.raises(openai.BadRequestError) as both:
            _complete(client, "limit-n", n=2)
        assert both.value.status_code == 400 and both.value.body["param"] == "n"
        assert _granted(s, "limit-n") == []
        assert s.wait_idle(HANG_GUARD).leases_expired == expired

        # A prefill holds the writer lock of the one slot (the test does, as a long prefill would) past the lease's
        # deadline: the lease lives on. Let go, and it expires.
        arena = s.decode.Reserve(pb.ReserveRequest(request_id="limit-probe", prompt_tokens=4), timeout=HANG_GUARD)
        assert s.decode.Release(pb.ReleaseRequest(request_id="limit-probe", lease=arena), timeout=HANG_GUARD).released
        s.wait_idle()
        locks = SlotLocks(os.open(arena.arena_path, os.O_RDWR), arena.slot_bytes)
        try:
            assert locks.try_lock(0)
            before = s.stats()
            lease = s.decode.Reserve(pb.ReserveRequest(request_id="limit-long", prompt_tokens=4, lease_ms=200),
                                     timeout=HANG_GUARD)
            wait_until(lambda: s.stats().admission.leases_extended == before.admission.leases_extended + 1,
                       "the lease to outlive its deadline", HANG_GUARD)
            st = s.stats()
            assert (st.slots_leased, st.leases_expired) == (1, before.leases_expired)
        finally:
            locks.unlock(0)
            locks.close()
        wait_until(lambda: s.stats().leases_expired == before.leases_expired + 1, "the lease to expire", HANG_GUARD)
        assert not s.decode.Release(pb.ReleaseRequest(request_id="limit-long", lease=lease),
                                    timeout=HANG_GUARD).released

        # SIGTERM while a Reserve waits: it is answered UNAVAILABLE at once, not left to time out.
        held = _hold(s, 1, "drain")
        waiting = s.decode.Reserve.future(pb.ReserveRequest(request_id="drain-wait", prompt_tokens=4),
                                          timeout=HANG_GUARD)
        _wait_queued(s, 1)
        s.procs["decode"].send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as drained:
            waiting.result(HANG_GUARD)
        assert drained.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in drained.value.details()
    finally:
        s.stop()


def _queue(slots: int, max_queue: int = 8) -> tuple[SlotTable, Admission]:
    """A real SlotTable of `slots` and the queue over it (inside a running event loop), without a worker."""
    table = SlotTable(slots, stamp=lambda slot, generation, secret: None, revoke=lambda slot: True,
                      writing=lambda slot: False)
    queue = Admission(table, asyncio.get_running_loop(), CollectorRegistry(), max_queue=max_queue,
                      timeout_s=HANG_GUARD)
    table.on_free = queue.slot_freed
    return table, queue


async def _settle() -> None:
    """Let every callback and task step scheduled so far run."""
    for _ in range(8):
        await asyncio.sleep(0)


def test_queue_order_when_a_slot_frees_and_callers_go_away():
    """The queue in process, over a real SlotTable of one slot, stepped by the event loop's own callback order (no
    timing): a newcomer never takes a slot the head is owed; a waiter that goes away leaves its place to the next;
    a slot granted in the instant its caller goes away is passed on."""
    async def main():
        table, queue = _queue(1)

        async def ask(rid):
            (s,), _ = await queue.reserve([(rid, 1)], 30.0)
            return s

        def give_back(s):
            assert table.release(s.index, s.generation, s.request_id, s.secret)

        first = await ask("a")
        b, c, d = (asyncio.ensure_future(ask(r)) for r in "bcd")
        await _settle()
        assert queue.depth == 3
        give_back(first)          # free now; the notice to the queue is a callback still to run
        b.cancel()                # the head goes away before it is served
        e = asyncio.ensure_future(ask("e"))
        await _settle()           # e arrives while the slot is free: it queues behind c and d, and c is served
        assert c.done() and c.result().request_id == "c" and not (d.done() or e.done())
        assert queue.depth == 2 and queue.cancelled == 1
        give_back(c.result())     # the notice runs first, granting d; then d's caller goes away
        asyncio.get_running_loop().call_soon(d.cancel)
        await _settle()
        assert d.cancelled() and queue.cancelled == 2
        assert (await asyncio.wait_for(e, HANG_GUARD)).request_id == "e"  # d's slot, passed on
        assert queue.depth == 0 and table.counts()["leased"] == 1

    asyncio.run(main())


def test_a_group_gets_all_its_slots_at_once_and_holds_its_place():
    """ReserveGroup's queueing, in process over a real SlotTable of three slots: a group of two waits while only
    one slot is free (it takes none of them), a single Reserve behind it waits too rather than take that slot,
    and the group is granted both slots in the instant a second one frees; the single then gets the next."""
    async def main():
        table, queue = _queue(3)

        (a, b), _ = await queue.reserve([("a", 1), ("b", 1)], 30.0)
        group = asyncio.ensure_future(queue.reserve([("g-0", 1), ("g-1", 1)], 30.0))
        single = asyncio.ensure_future(queue.reserve([("s", 1)], 30.0))
        await _settle()
        assert queue.depth == 2 and table.counts()["free"] == 1 and not (group.done() or single.done())
        assert table.release(a.index, a.generation, a.request_id, a.secret)
        await _settle()
        granted, _ = group.result()
        assert [s.request_id for s in granted] == ["g-0", "g-1"] and not single.done()
        assert table.release(b.index, b.generation, b.request_id, b.secret)
        assert [s.request_id for s in (await asyncio.wait_for(single, HANG_GUARD))[0]] == ["s"]
        with pytest.raises(ValueError):
            await queue.reserve([(f"x-{i}", 1) for i in range(4)], 30.0)  # more than the table has

    asyncio.run(main())


def test_priority_orders_the_queue():
    """With priorities (the gateway's --scheduling-policy priority) the queue serves the lowest value first and
    arrival order among equals; a newcomer of a lower value than every waiter is the next served, a group included
    (it holds the head until its slots are free)."""
    async def main():
        table, queue = _queue(2, max_queue=16)
        served: list[list] = []  # the slots of each grant, in the order granted

        async def ask(members, priority):
            slots, _ = await queue.reserve([(m, 1) for m in members], 30.0, priority)
            served.append(slots)

        await ask(["x", "y"], 0)
        tasks = [asyncio.ensure_future(ask([rid], p)) for rid, p in
                 (("late-0", 0), ("batch-5", 5), ("urgent", -1), ("late-1", 0), ("batch-6", 5))]
        await _settle()
        tasks.append(asyncio.ensure_future(ask(["g-0", "g-1"], -3)))   # a group that outranks everyone
        await _settle()
        assert queue.depth == 6
        released = 0
        while released < len(served):  # give back the slots in the order they were granted, one at a time
            for s in served[released]:
                assert table.release(s.index, s.generation, s.request_id, s.secret)
                await _settle()
            released += 1
        await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD)
        assert [",".join(s.request_id for s in grant) for grant in served] == \
            ["x,y", "g-0,g-1", "urgent", "late-0", "late-1", "batch-5", "batch-6"]

    asyncio.run(main())


def test_a_full_queue_takes_a_caller_that_outranks_its_last():
    """max_queue 2, both waiting at priority 5: a caller at 0 takes the last one's place (that one is refused as
    a full queue refuses), a caller at 5 or worse is refused itself."""
    from splitgemma.services.decode.admission import QueueFull

    async def main():
        table, queue = _queue(1, max_queue=2)

        (held,), _ = await queue.reserve([("held", 1)], 30.0)
        first, second = (asyncio.ensure_future(queue.reserve([(r, 1)], 30.0, 5)) for r in ("b-1", "b-2"))
        await _settle()
        with pytest.raises(QueueFull):
            await queue.reserve([("b-3", 1)], 30.0, 5)
        urgent = asyncio.ensure_future(queue.reserve([("urgent", 1)], 30.0, 0))
        await _settle()
        with pytest.raises(QueueFull, match="higher priority took this one's place"):
            await second
        assert queue.depth == 2 and queue.refused_full == 2 and not first.done()
        assert table.release(held.index, held.generation, held.request_id, held.secret)
        (got,), _ = await asyncio.wait_for(urgent, HANG_GUARD)
        assert got.request_id == "urgent" and not first.done()
        first.cancel()

    asyncio.run(main())


def test_drain_estimate():
    """Retry-After from given timestamps (no clock): the mean interval between frees, times the caller's position."""
    r = DrainEstimate()
    assert r.interval(100.0) is None and r.per_second(100.0) == 0
    assert r.retry_after(3, 100.0, unmeasured=7.0) == 7.0  # nothing measured: the caller's fallback
    r.note(100.0)
    assert r.interval(100.0) is None  # one free is no interval yet
    # Slots free every 0.4 s: the hint for the 5th in line is 2 s, not a default.
    for i in range(1, 6):
        r.note(100.0 + 0.4 * i)
    assert abs(r.interval(102.0) - 0.4) < 1e-9 and abs(r.per_second(102.0) - 2.5) < 1e-9
    assert abs(r.retry_after(5, 102.0, unmeasured=15.0) - 2.0) < 1e-9
    assert r.retry_after(1, 102.0, unmeasured=15.0) == RETRY_MIN_S  # 0.4 s: Retry-After has whole seconds
    # Nothing freed since: the open interval counts once it is longer than the mean.
    assert r.interval(105.0) == 3.0 and r.retry_after(2, 105.0, unmeasured=15.0) == 6.0
    # A lull longer than IDLE_GAP_S is not an interval of the drain: the estimate from before it stands and fast
    # frees after it keep it fast.
    r.note(200.0)
    r.note(200.2)
    assert r.interval(200.2) < 0.4
    # A slower drain moves the mean towards it, weighted towards the newest intervals.
    for i in range(1, 30):
        r.note(200.2 + 2.0 * i)
    assert 1.9 < r.interval(200.2 + 58.0) <= 2.0
    assert r.retry_after(10_000, 300.0, unmeasured=1.0) == 3600.0  # capped
