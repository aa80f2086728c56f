"""Leases as capabilities (docs/security.md, "Leases"), attacked through the gRPC contract of real worker processes:
a local process that can reach both workers' ports reserves a lease of its own to learn what a Reserve tells, then
tries to write, run or give back another client's leased slot with leases it forged from that (neighbouring
generations, the victim's generation with a wrong or no secret, a released lease, an expired one). Every attempt is
refused with a precise status, the arena file's bytes are unchanged (read straight from the file), and the victim's
request then runs as if nothing had happened. Also: the lease length cap, and a worker refusing a port that is
taken. Nothing here depends on the machine's speed: expiry is waited for through Stats, never slept on."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from splitgemma.serving.shm_arena import PREFIX
from splitgemma.v1 import serving_pb2 as pb
from test_workers import CHUNK, CTX, FGM, RPC_TIMEOUT, Client, Worker, greedy, prompt_of, status_of, tokens_of
from tools.procs import SPLITGEMMA, LoggedProcess, private_shm, wait_until

MAX_LEASE_MS = 20_000
N_PROMPT, N_OUT = 40, 8


@pytest.fixture(scope="module")
def shm_dir():
    with private_shm("leases") as d:
        yield d


@pytest.fixture(scope="module")
def geometry(shm_dir) -> list[str]:
    return ["--model", str(FGM), "--max-context", str(CTX), "--chunk", str(CHUNK), "--shm-dir", str(shm_dir)]


@pytest.fixture(scope="module")
def pair(geometry, tmp_path_factory):
    """A decode worker with two slots (so which slot a Reserve gets is known: the longest-free first) and a lease
    cap, and a prefill worker."""
    logs = tmp_path_factory.mktemp("leases")
    d = Worker("decode", [*geometry, "--slots", "2", "--lease-ms", "10000", "--max-lease-ms", str(MAX_LEASE_MS)],
               logs / "decode.log")
    p = Worker("prefill", geometry, logs / "prefill.log")
    try:
        d.wait_ready()
        p.wait_ready()
        yield Client(d, p)
    finally:
        d.stop()
        p.stop()


def arena_bytes(lease: pb.Lease) -> bytes:
    """The whole arena file, read from the file itself (not through the workers)."""
    return Path(lease.arena_path).read_bytes()


def slot_bytes(data: bytes, lease: pb.Lease, slot: int) -> bytes:
    return data[slot * lease.slot_bytes:(slot + 1) * lease.slot_bytes]


def forged(lease: pb.Lease, **fields) -> pb.Lease:
    out = pb.Lease()
    out.CopyFrom(lease)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def test_forged_leases_write_nothing(pair):
    c = pair
    victim_prompt, attacker_prompt = prompt_of(1, N_PROMPT), prompt_of(2, N_PROMPT)
    # The history of the victim's slot: a lease that expired on it, and one released on the other slot.
    before = c.stats()
    expired = c.reserve("old-expired", N_PROMPT, lease_ms=150)
    wait_until(lambda: c.stats().leases_expired == before.leases_expired + 1, "the lease to expire", RPC_TIMEOUT)
    released = c.reserve("old-released", N_PROMPT)
    assert c.decode.Release(pb.ReleaseRequest(request_id="old-released", lease=released),
                            timeout=RPC_TIMEOUT).released
    c.wait_idle()
    victim = c.reserve("victim", N_PROMPT, N_OUT)
    attacker = c.reserve("attacker", N_PROMPT, N_OUT)
    assert victim.slot == expired.slot != attacker.slot == released.slot  # the longest-free slot goes first
    victim_pre = c.prefill.Prefill(c.prefill_req("victim", victim_prompt, victim, greedy()), timeout=RPC_TIMEOUT)

    # What the attacker's own Reserve tells about the victim's lease: nothing. The secrets are 256 random bits each,
    # and the generations are random too (a counter would put the victim's one or two steps from the attacker's).
    assert len(attacker.secret) == len(victim.secret) == 32 and attacker.secret != victim.secret
    assert abs(attacker.generation - victim.generation) > 1 << 32
    assert len({expired.generation, released.generation, victim.generation, attacker.generation}) == 4

    arena = arena_bytes(victim)
    guesses = [
        # Generations next to the attacker's own (what worked against a counter), with its own secret.
        *[(forged(attacker, slot=victim.slot, generation=(attacker.generation + d) % (1 << 64)),
           grpc.StatusCode.FAILED_PRECONDITION, "not leased to generation") for d in (-2, -1, 1, 2)],
        # The victim's generation (say it leaked) with the attacker's secret, a random one, or none.
        (forged(victim, secret=attacker.secret), grpc.StatusCode.PERMISSION_DENIED, "forged lease"),
        (forged(victim, secret=secrets.token_bytes(32)), grpc.StatusCode.PERMISSION_DENIED, "forged lease"),
        (forged(victim, secret=b""), grpc.StatusCode.INVALID_ARGUMENT, "secret must be 32 bytes"),
        (forged(victim, secret=victim.secret[:16]), grpc.StatusCode.INVALID_ARGUMENT, "secret must be 32 bytes"),
        # The victim's secret bound to another worker id (the digest covers it).
        (forged(victim, worker_id="decode-elsewhere"), grpc.StatusCode.PERMISSION_DENIED, "forged lease"),
        # A released lease, as it was (its slot is the attacker's now) and aimed at the victim's slot.
        (released, grpc.StatusCode.FAILED_PRECONDITION, "not leased to generation"),
        (forged(released, slot=victim.slot), grpc.StatusCode.FAILED_PRECONDITION, "not leased to generation"),
        # An expired lease of the victim's slot: refused on its deadline, and with the deadline moved on.
        (expired, grpc.StatusCode.DEADLINE_EXCEEDED, "expired before the prefill started"),
        (forged(expired, deadline_unix_ms=int(time.time() * 1000) + 60_000), grpc.StatusCode.FAILED_PRECONDITION,
         "not leased to generation"),
    ]
    for lease, code, words in guesses:
        # The request id too is the victim's: the header seal would carry it, had anything been written.
        got, msg = status_of(lambda: c.prefill.Prefill(c.prefill_req("victim", attacker_prompt, lease, greedy()),
                                                       timeout=RPC_TIMEOUT))
        assert (got, words in msg) == (code, True), (lease.generation, msg)
        if code != grpc.StatusCode.INVALID_ARGUMENT:
            assert "nothing was written" in msg
    after = arena_bytes(victim)
    assert slot_bytes(after, victim, victim.slot) == slot_bytes(arena, victim, victim.slot)
    assert after == arena  # the attacker's slot, released's, is untouched too

    # The decode worker: Generate and Release of the victim's lease without its secret are refused and leave the
    # lease alone.
    for lease, code in ((forged(victim, secret=attacker.secret), grpc.StatusCode.PERMISSION_DENIED),
                        (forged(victim, secret=b""), grpc.StatusCode.INVALID_ARGUMENT)):
        got, _ = status_of(lambda: list(c.decode.Generate(c.gen_req("victim", lease, N_PROMPT, victim_pre, greedy(),
                                                                    N_OUT), timeout=RPC_TIMEOUT)))
        assert got == code
        got, _ = status_of(lambda: c.decode.Release(pb.ReleaseRequest(request_id="victim", lease=lease),
                                                    timeout=RPC_TIMEOUT))
        assert got == code
    neighbour = forged(attacker, slot=victim.slot, generation=(attacker.generation + 1) % (1 << 64))
    got, _ = status_of(lambda: list(c.decode.Generate(c.gen_req("victim", neighbour, N_PROMPT, victim_pre, greedy(),
                                                                N_OUT), timeout=RPC_TIMEOUT)))
    assert got == grpc.StatusCode.FAILED_PRECONDITION
    assert not c.decode.Release(pb.ReleaseRequest(request_id="victim", lease=neighbour), timeout=RPC_TIMEOUT).released
    assert c.stats().slots_leased == 2
    assert arena_bytes(victim) == arena

    # The victim's request runs unharmed: the same tokens as the same prompt run after everything is over.
    events = list(c.decode.Generate(c.gen_req("victim", victim, N_PROMPT, victim_pre, greedy(), N_OUT,
                                              ignore_eos=True), timeout=RPC_TIMEOUT))
    assert c.decode.Release(pb.ReleaseRequest(request_id="attacker", lease=attacker), timeout=RPC_TIMEOUT).released
    c.wait_idle()
    _, _, clean = c.run("clean", victim_prompt, N_OUT, greedy(), ignore_eos=True)
    assert [t.token_id for t in tokens_of(events)] == [t.token_id for t in tokens_of(clean)]
    assert len(tokens_of(events)) == N_OUT
    c.wait_idle()


def test_lease_length_is_capped(pair):
    """A Reserve asking for an hour gets --max-lease-ms (the lease's deadline says so), so nobody can take every
    slot for longer than that."""
    t0 = time.time()
    lease = pair.reserve("greedy-lease", 4, lease_ms=3_600_000)
    granted_s = lease.deadline_unix_ms / 1000 - t0
    assert MAX_LEASE_MS / 1000 - RPC_TIMEOUT <= granted_s <= MAX_LEASE_MS / 1000 + 1
    assert pair.stats().admission.max_lease_ms == MAX_LEASE_MS
    assert pair.decode.Release(pb.ReleaseRequest(request_id="greedy-lease", lease=lease), timeout=RPC_TIMEOUT).released
    pair.wait_idle()


def test_default_lease_above_the_cap_is_refused(geometry):
    r = subprocess.run([*SPLITGEMMA, "decode", *geometry, "--lease-ms", "70000", "--max-lease-ms", "60000"],
                       capture_output=True, text=True, timeout=RPC_TIMEOUT)
    assert r.returncode == 1 and "--lease-ms 70000 exceeds --max-lease-ms 60000" in r.stderr


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_taken_port_is_refused(pair, geometry, shm_dir, kind, tmp_path):
    """gRPC's default SO_REUSEPORT would let a second worker share the port of the first (the kernel spreading calls
    over both); each worker turns it off and stops with a message naming the port."""
    taken = (pair.decode_worker if kind == "decode" else pair.prefill_worker).port
    arenas = sorted(n for n in os.listdir(shm_dir) if n.startswith(PREFIX))
    second = LoggedProcess([*SPLITGEMMA, kind, *geometry, "--port", str(taken), "--threads", "1",
                            *(["--slots", "1"] if kind == "decode" else [])], tmp_path / "second.log")
    try:
        assert second.wait(RPC_TIMEOUT * 3) == 1
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert f"cannot listen on 127.0.0.1:{taken}: address already in use" in second.log()
    assert f"port {taken}?" in second.log()
    assert sorted(n for n in os.listdir(shm_dir) if n.startswith(PREFIX)) == arenas  # its arena went with it
    assert pair.stats().slots_total == 2  # the first still answers
