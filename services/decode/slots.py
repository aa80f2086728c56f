"""The decode worker's slot leases: which KV slot is free, leased (reserved, waiting for its prefill and
Generate), running (in the decode batch) or quarantined.

A lease is (slot, generation, secret), a capability: whoever presents it may write the slot (Prefill), run it
(Generate) and give it back (Release), and nobody else. Every reservation draws both at random (`secrets`): the
generation (64 bits, never 0, never the slot's previous one) names the reservation, so a lease from an earlier
reservation of the slot, or from an earlier run of a worker with the same id, does not match; the secret (256 bits)
is what authorises. Neither is derived from anything another caller sees, so one's own leases (or any number of
them) tell nothing about another's; compared with hmac.compare_digest.

The arena records which lease may write a slot (`stamp`, when it is leased: the generation and a keyed digest of
the secret, shm_arena.lease_digest, never the secret itself). A slot whose lease ends without a
verified handoff (released, expired, refused) may still have a prefill writing into it: the prefill worker notices
a cancellation or the lease deadline only between chunks. Every slot whose lease ends is taken back with `revoke`,
which succeeds only when no prefill holds the slot's writer lock, and clears the stamp so that none can start
(splitgemma/serving/shm_arena.py). Until then the slot is quarantined and `tick` retries. After a verified run the
prefill has long let go, so the slot is free at once.

A lease whose prefill is still running must not expire under it (prompts may wait for the prefill worker behind
others, and a long prompt takes long): `tick` looks at the writer lock of every leased slot (without taking it) and,
while a prefill holds it, keeps the deadline at least one lease length ahead. Only a lease nobody is writing expires,
one lease length after its grant or after its prefill was last seen writing, whichever is later.

Reserve never waits here: the queue of callers waiting for a slot is services/decode/admission.py, which `on_free`
tells (from any thread: the batch thread frees finished sequences' slots).
"""

from __future__ import annotations

import enum
import hmac
import secrets
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from splitgemma.serving.shm_arena import LEASE_SECRET_BYTES


class State(enum.Enum):
    FREE = "free"
    LEASED = "leased"
    RUNNING = "running"  # claimed by a Generate (being verified, or in the batch)
    QUARANTINE = "quarantine"


class Claim(enum.Enum):
    OK = "ok"
    UNKNOWN = "unknown"  # no such live lease (never issued, released, finished)
    EXPIRED = "expired"
    MISMATCH = "mismatch"  # the slot is leased or running under another generation or request id
    FORGED = "forged"  # the live lease's generation and request id, presented with another secret


class ForgedLease(Exception):
    """A live lease presented with the wrong secret: nothing was done."""


@dataclass
class Slot:
    index: int
    state: State = State.FREE
    generation: int = 0
    request_id: str = ""
    secret: bytes = field(default=b"", repr=False)  # the lease's capability (Lease.secret)
    deadline: float = 0.0  # unix seconds: the lease is revoked after this unless claimed
    max_tokens: int = 0  # as reserved
    lease_s: float = 0.0  # the lease length: how far ahead of a writing prefill the deadline is kept
    granted_deadline: float = 0.0  # the deadline without extensions
    extended: bool = False  # a prefill was still writing at granted_deadline: the lease lived on
    sequence: object = None  # the running sequence (cancel() on Release)
    released: bool = False  # Release came while the Generate was still being admitted


_EXPIRED_MEMORY = 4096  # expired leases remembered, to answer DEADLINE_EXCEEDED rather than NOT_FOUND


class SlotTable:
    def __init__(self, n_slots: int, stamp: Callable[[int, int, bytes], None], revoke: Callable[[int], bool],
                 writing: Callable[[int], bool]):
        """stamp(slot, generation, secret): let that lease's prefill write the slot. revoke(slot): True once no prefill
        writes the slot and none can start; False, at once, while one still does. writing(slot): does a prefill hold
        the slot's writer lock (looking only)?"""
        self._stamp, self._revoke, self._writing = stamp, revoke, writing
        # Called whenever a slot becomes free, with the table's lock held (so it must only schedule work); the
        # admission queue sets it.
        self.on_free: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._slots = [Slot(i) for i in range(n_slots)]
        # Free slots in the order they were freed: the longest-free is leased first.
        self._free = deque(range(n_slots))
        self._expired: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.leases_expired = 0
        self.leases_extended = 0

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def reserve(self, members: list[tuple[str, int]], lease_s: float, now: float) -> list[Slot] | None:
        """Lease one slot per (request_id, max_tokens) member, all or none: copies of the leases (the longest-free
        slots), or None when fewer slots than members are free."""
        with self._lock:
            if len(self._free) < len(members):
                return None
            return [self._lease(self._slots[self._free.popleft()], rid, max_tokens, lease_s, now)
                    for rid, max_tokens in members]

    def _lease(self, s: Slot, request_id: str, max_tokens: int, lease_s: float, now: float) -> Slot:
        generation = secrets.randbits(64)
        while generation in (0, s.generation):  # 0 is the revoked stamp
            generation = secrets.randbits(64)
        secret = secrets.token_bytes(LEASE_SECRET_BYTES)
        self._stamp(s.index, generation, secret)
        s.state, s.generation, s.request_id, s.secret = State.LEASED, generation, request_id, secret
        s.deadline, s.max_tokens, s.sequence, s.released = now + lease_s, max_tokens, None, False
        s.lease_s, s.granted_deadline, s.extended = lease_s, s.deadline, False
        return Slot(**vars(s))

    def claim(self, slot: int, generation: int, request_id: str, secret: bytes,
              now: float) -> tuple[Claim, Slot | None]:
        """Move a live lease to RUNNING for its Generate. Returns the verdict and a copy of the slot."""
        with self._lock:
            s = self._slots[slot]
            if s.state is State.LEASED and s.generation == generation and s.request_id == request_id:
                if not hmac.compare_digest(s.secret, secret):
                    return Claim.FORGED, None
                if now > s.deadline:
                    self._expire(s)
                    return Claim.EXPIRED, None
                s.state = State.RUNNING
                return Claim.OK, Slot(**vars(s))
            if (slot, generation) in self._expired:
                return Claim.EXPIRED, None
            if s.state in (State.LEASED, State.RUNNING):
                return Claim.MISMATCH, Slot(**vars(s))
            return Claim.UNKNOWN, None

    def attach(self, slot: int, sequence) -> None:
        """Record the admitted sequence of a claimed slot (so that Release can cancel it)."""
        with self._lock:
            s = self._slots[slot]
            s.sequence = sequence
            if s.released:
                sequence.cancel()

    def release(self, slot: int, generation: int, request_id: str, secret: bytes) -> bool:
        """Give a lease back. A running sequence is cancelled (the batch loop frees its slot). False when the
        lease is not live; ForgedLease when it is, but `secret` is not its secret."""
        with self._lock:
            s = self._slots[slot]
            live = s.state in (State.LEASED, State.RUNNING)
            if not live or s.generation != generation or s.request_id != request_id:
                return False
            if not hmac.compare_digest(s.secret, secret):
                raise ForgedLease(f"slot {slot}: the secret presented is not the lease's")
            if s.state is State.LEASED:
                self._retire(s)
            elif s.sequence is not None:
                s.sequence.cancel()
            else:
                s.released = True
            return True

    def refuse(self, slot: int) -> None:
        """A claimed slot whose Generate was refused (bad header or request): quarantine it."""
        with self._lock:
            s = self._slots[slot]
            if s.state is State.RUNNING:
                self._retire(s)

    def finish(self, slot: int) -> None:
        """A running sequence ended. Its prefill sealed before the handoff, so revoking the lease succeeds at once and
        the slot is free; a duplicate Prefill of the same lease still writing would keep it quarantined."""
        with self._lock:
            s = self._slots[slot]
            if s.state is State.RUNNING:
                self._retire(s)

    def tick(self, now: float) -> list[Slot]:
        """Keep the leases of prefills in progress alive, revoke the other leases past their deadline and end
        quarantines that are over. Returns the revoked leases."""
        expired = []
        with self._lock:
            for s in self._slots:
                if s.state is State.LEASED and self._writing(s.index):
                    s.deadline = max(s.deadline, now + s.lease_s)
                    if now > s.granted_deadline and not s.extended:
                        s.extended = True
                        self.leases_extended += 1
                elif s.state is State.LEASED and now > s.deadline:
                    expired.append(Slot(**vars(s)))
                    self._expire(s)
                elif s.state is State.QUARANTINE and self._revoke(s.index):
                    self._set_free(s)
        return expired

    def counts(self) -> dict[str, int]:
        with self._lock:
            out = {st.value: 0 for st in State}
            for s in self._slots:
                out[s.state.value] += 1
            return out

    def _expire(self, s: Slot) -> None:
        self.leases_expired += 1
        self._expired[(s.index, s.generation)] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        self._retire(s)

    def _retire(self, s: Slot) -> None:
        s.sequence = None
        if self._revoke(s.index):
            self._set_free(s)
        else:
            s.state = State.QUARANTINE

    def _set_free(self, s: Slot) -> None:
        s.state = State.FREE
        self._free.append(s.index)
        self.on_free()
