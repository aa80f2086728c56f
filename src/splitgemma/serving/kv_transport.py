"""The network KV transport: a prefill worker that cannot map its decode worker's arena (another host, another
/dev/shm) streams the prompt's K/V to the decode worker (Decode.PushKv), which writes it into the leased slot.

The lease/header contract is the shared-memory path's (shm_arena.py, docs/security.md), only the writer moves:

* Which transport (prefill side, `arena_reachable`): shared memory when the lease's arena file opens under this
  worker's --shm-dir with the lease's geometry and its slot header holds the lease's generation (a 64-bit random
  number only that decode worker stamped there: a file of the same name on another host cannot hold it); otherwise
  the network, when the lease names an address to reach the decode worker (Lease.kv_address). Chosen per call, so
  per pair of workers, and reported in PrefillResponse.kv_transport, PrefillStats, metrics and the trace.
* The prefill worker computes into a staging slot of its own (anonymous memory, the same layout: `StagingSlots`)
  and, after each chunk, sends that chunk's positions as KvArena.export_positions packs them (`KvSender`), while the
  model thread goes on with the next chunk: the transfer overlaps compute. Positions restored from its prefix cache
  are sent as the cache's own blocks. The bytes on the wire per prompt token are the layout's position_bytes (plus a
  few bytes of framing per part): no ring rows, no padding, no header.
* The decode worker (`KvReceiver`) opens the arena file again for the stream (its own open file description, so the
  slot's writer lock — an OFD lock — keeps it apart from every other writer, its own other streams included), takes
  that lock, and checks the slot's lease stamp exactly as a prefill worker does before writing (`stamp_refusal`):
  a stale lease (another generation) or a forged one (the secret does not yield the stamped digest) writes
  nothing. While it holds the lock the decode worker's lease table sees a writer and keeps the lease alive, and
  cannot hand the slot out again. Each part goes in with KvArena.import_positions, which leaves the slot unsealed;
  only the final seal, after every position arrived and the checksum of what was written equals the prefill
  worker's seal of its staging slot, seals the header. A stream that breaks off (the prefill worker killed, a
  cancellation, a bad part, no part within `idle_timeout`) lets the lock go with the slot unsealed: Generate's
  verify refuses it, as for a prefill killed mid-write on shared memory.

The service credential (token metadata, TLS) covers PushKv as every other worker call: the prefill worker dials with
its --service-token-file and --kv-tls-* files.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import mmap
import os
import stat
import threading
import time
from dataclasses import dataclass

import grpc

from splitgemma.engine import KvArena
from splitgemma.serving import credentials, telemetry
from splitgemma.serving.worker import MAX_MESSAGE_BYTES
from splitgemma.serving.shm_arena import (ArenaError, InvalidLease, LEASE_SECRET_BYTES, PREFIX, MappedArena, SlotLocks,
                                          lease_digest, request_key)
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pb_grpc

log = logging.getLogger("splitgemma.kv_transport")

SHM, NETWORK = "shm", "network"
# A computed chunk goes out as exports of at most this many bytes (whole positions; at least one): the first leave
# while the rest are packed, and no message nears a gRPC message limit whatever the chunk. An export is packed
# layer by layer (docs/engine-api.md), so a range of positions is cut by exporting sub-ranges, never by slicing
# bytes. A prefix-cache block is sent whole (one chunk of positions: 2.4 MB for E2B at chunk 256); the decode
# worker accepts messages up to worker.MAX_MESSAGE_BYTES.
PART_BYTES = 1 << 20
_LOCK_POLL_S = (0.002, 0.02)  # as the prefill worker polls a held writer lock


def stamp_refusal(header: dict, slot: int, generation: int, digest: bytes) -> tuple[grpc.StatusCode, str] | None:
    """Why the lease (generation, digest of its secret) may not write the slot whose header is `header`, as a gRPC
    status and message, or None when it may. Asked under the slot's writer lock, before anything is written: the
    decode worker stamps the generation and the digest when it leases the slot and clears both, under the same lock,
    when it takes the slot back, so while the caller holds the lock the answer cannot change."""
    if header["generation"] != generation:
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"slot {slot} is not leased to generation {generation} (the lease was revoked: released or expired, "
                "or was never issued); nothing was written")
    if not hmac.compare_digest(header["lease_digest"], digest):
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"the lease's secret does not match the one slot {slot} is leased with (a forged lease); nothing was "
                "written")
    return None


def arena_reachable(view: MappedArena, lease) -> bool:
    """Is the mapped file the lease's arena: does its slot header hold the lease's generation? (The proof of the
    shared-memory path; a peek, without the lock: the write itself checks again under it.)"""
    return view.arena.header(lease.slot)["generation"] == lease.generation


def outside(path: str, directory: str) -> bool:
    """Is the arena path of a lease not directly in `directory` (so not this host's to map)?"""
    return os.path.realpath(os.path.dirname(path)) != os.path.realpath(directory)


def export_parts(arena, slot: int, begin: int, end: int, part_bytes: int = PART_BYTES):
    """(pos0, export) pieces of positions [begin, end) of the slot, each KvArena.export_positions of a sub-range of
    at most part_bytes (at least one position): imported in order they leave what one export would."""
    step = max(1, part_bytes // arena.model.kv_layout["position_bytes"])
    for p in range(begin, end, step):
        yield p, arena.export_positions(slot, p, min(end, p + step))


# ---------------------------------------------------------------------------------------------------------------
# The prefill side


class StagingSlots:
    """Slots of the prefill worker's own, one per network prompt in flight: anonymous memory of the layout's slot
    size (pages are allocated as a prompt touches them), kept for reuse up to `keep` and otherwise unmapped."""

    def __init__(self, model, keep: int = 2):
        self.model = model
        self.keep = keep
        self._free: list[MappedArena] = []
        self._lock = threading.Lock()

    def take(self) -> MappedArena:
        with self._lock:
            if self._free:
                return self._free.pop()
        buf = mmap.mmap(-1, self.model.kv_slot_bytes)
        # identity: a key no arena file has (st_dev of a file is never -1), unique per staging slot
        return MappedArena("<staging>", (-1, id(buf)), 1, self.model.kv_slot_bytes, KvArena(self.model, buf, 1), buf,
                           locks=None)

    def give_back(self, view: MappedArena) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(view)


class KvChannels:
    """gRPC channels to decode workers by address, with the service credential (token metadata and, with
    --kv-tls-*, TLS)."""

    def __init__(self, token: str | None, tls: credentials.TlsFiles | None):
        self._interceptors = [*telemetry.grpc_client_interceptors(), *credentials.client_interceptors(token)]
        self._tls = tls.channel_credentials() if tls is not None and tls.enabled else None
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> pb_grpc.DecodeStub:
        channel = self._channels.get(address)
        if channel is None:
            options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
            channel = (grpc.aio.insecure_channel(address, options=options, interceptors=self._interceptors)
                       if self._tls is None else
                       grpc.aio.secure_channel(address, self._tls, options=options, interceptors=self._interceptors))
            self._channels[address] = channel
        return pb_grpc.DecodeStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()


class PushRefused(Exception):
    """The decode worker ended the stream: `code` and `details` are its status (the Prefill call answers them)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class KvSender:
    """One prompt's stream to the decode worker. `open` and `seal` run on the event loop; `send` and `send_range`
    are called from the model thread (they only queue parts: the loop writes them while the next chunk computes)."""

    def __init__(self, stub: pb_grpc.DecodeStub, request_id: str, lease, prompt_tokens: int, timeout: float | None,
                 on_broken=lambda: None):
        """on_broken() runs (on the loop) when the stream fails while parts are being written."""
        self._call = stub.PushKv(timeout=timeout)
        self._on_broken = on_broken
        self.broken: PushRefused | None = None  # why the stream failed under the writer
        self._open = pb.KvPushOpen(request_id=request_id, lease=lease, prompt_tokens=prompt_tokens)
        self.wire_bytes = 0  # K/V bytes handed to gRPC
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._writer: asyncio.Task | None = None

    async def open(self) -> None:
        """Open the stream and wait until the decode worker holds the slot's lock and accepted the lease."""
        self._loop = asyncio.get_running_loop()
        try:
            await self._call.write(pb.KvPush(open=self._open))
            reply = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise PushRefused(e.code(), e.details()) from None
        if reply is grpc.aio.EOF or not reply.accepted:
            raise await self._refusal("the decode worker ended the KV stream before accepting the lease")
        self._writer = asyncio.create_task(self._write_parts(), name="kv-push")

    def send(self, pos0: int, export) -> None:
        """Queue an export of positions from pos0 on, as it is (a prefix-cache block; any thread)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (pos0, export))

    def send_range(self, arena, slot: int, begin: int, end: int) -> None:
        """Queue positions [begin, end) of the slot, just computed (the model thread, before the next chunk)."""
        for part in export_parts(arena, slot, begin, end):
            self.send(*part)

    async def _write_parts(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            pos0, data = item
            try:
                await self._call.write(pb.KvPush(positions=pb.KvPositions(pos0=pos0, data=data)))
            except grpc.aio.AioRpcError as e:
                self.broken = PushRefused(e.code(), e.details())
            except asyncio.InvalidStateError:  # the call ended (the decode worker closed it)
                self.broken = await self._refusal("the decode worker ended the KV stream")
            if self.broken is not None:
                self._on_broken()
                return
            self.wire_bytes += len(data)

    async def seal(self, n_tokens: int, checksum: int) -> pb.KvPushSealed:
        """After the last part: ask the decode worker to seal the slot, and wait for its answer."""
        self._queue.put_nowait(None)
        await self._writer
        if self.broken is not None:
            raise self.broken
        try:
            await self._call.write(pb.KvPush(seal=pb.KvPushSeal(n_tokens=n_tokens, checksum=checksum)))
            await self._call.done_writing()
            reply = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise PushRefused(e.code(), e.details()) from None
        if reply is grpc.aio.EOF or not reply.HasField("sealed"):
            raise await self._refusal("the decode worker ended the KV stream without sealing the slot")
        return reply.sealed

    async def _refusal(self, fallback: str) -> PushRefused:
        code = await self._call.code()
        details = await self._call.details()
        if code == grpc.StatusCode.OK:
            return PushRefused(grpc.StatusCode.INTERNAL, fallback)
        return PushRefused(code, details)

    def cancel(self) -> None:
        """Break the stream off (the prompt stopped): the decode worker lets the slot go unsealed."""
        if self._writer is not None:
            self._writer.cancel()
        self._call.cancel()


# ---------------------------------------------------------------------------------------------------------------
# The decode side


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class ReceiverStats:
    sealed: int = 0
    refused: int = 0
    open: int = 0
    bytes: int = 0


class KvReceiver:
    """The decode worker's end of PushKv, writing into its own arena (`shm`, a ShmArena)."""

    def __init__(self, shm, model, worker_id: str, idle_timeout: float, on_done=None):
        """on_done(outcome, bytes) after each stream ("sealed", or the status name that ended it), for metrics."""
        self.shm, self.model, self.worker_id = shm, model, worker_id
        self.idle_timeout = idle_timeout
        self.position_bytes = model.kv_layout["position_bytes"]
        self.stats = ReceiverStats()
        self._on_done = on_done or (lambda outcome, n: None)

    async def push(self, requests, context):
        """The PushKv handler (an async generator of replies)."""
        self.stats.open += 1
        received = 0
        outcome = "cancelled"
        locks = None
        try:
            first = await self._next(requests)
            if first is None or first.WhichOneof("part") != "open":
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the KV stream must start with `open`")
            rid, lease, n = first.open.request_id, first.open.lease, first.open.prompt_tokens
            digest = self._check_open(rid, lease, n)
            locks = SlotLocks(self._open_fd(), self.shm.slot_bytes)
            await self._lock(locks, lease.slot, context)
            refusal = stamp_refusal(self.shm.arena.header(lease.slot), lease.slot, lease.generation, digest)
            if refusal is not None:
                raise _Refused(*refusal)
            yield pb.KvPushReply(accepted=True)
            pos = 0
            while True:
                msg = await self._next(requests)
                if msg is None:
                    raise _Refused(grpc.StatusCode.CANCELLED, f"the KV stream ended after {pos} of {n} positions, "
                                                              "without a seal; the slot was left unsealed")
                kind = msg.WhichOneof("part")
                if kind == "positions":
                    pos = await self._write(lease.slot, pos, n, msg.positions)
                    received += len(msg.positions.data)
                    self.stats.bytes += len(msg.positions.data)
                elif kind == "seal":
                    checksum = await self._seal(rid, lease, pos, n, msg.seal)
                    outcome = "sealed"
                    yield pb.KvPushReply(sealed=pb.KvPushSealed(checksum=checksum, bytes_received=received))
                    return
                else:
                    raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "a second `open` in one KV stream")
        except _Refused as e:
            outcome = e.code.name.lower()
            log.warning("KV push refused", extra={"reason": str(e), "code": e.code.name})
            await context.abort(e.code, str(e))
        finally:
            if locks is not None:
                locks.close()  # closing the file description drops its lock (held or not)
            self.stats.open -= 1
            if outcome == "sealed":
                self.stats.sealed += 1
            else:
                self.stats.refused += 1
            self._on_done(outcome, received)

    async def _next(self, requests):
        try:
            return await asyncio.wait_for(anext(requests, None), self.idle_timeout)
        except asyncio.TimeoutError:
            raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"no KV part arrived for {self.idle_timeout:g} s; the slot was left unsealed") from None

    def _check_open(self, rid: str, lease, n: int) -> bytes:
        if lease.worker_id != self.worker_id:
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"the lease is for worker {lease.worker_id!r}; this is "
                                                      f"{self.worker_id!r}")
        if not rid:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if lease.slot >= self.shm.n_slots:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"slot {lease.slot} out of range (0..{self.shm.n_slots - 1})")
        if not 1 <= n <= self.model.max_context:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt_tokens {n} is outside 1..{self.model.max_context} (the slot context)")
        if len(lease.secret) != LEASE_SECRET_BYTES:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"the lease's secret must be {LEASE_SECRET_BYTES} bytes, got {len(lease.secret)}")
        try:
            return lease_digest(lease.worker_id, lease.slot, lease.generation, lease.secret)
        except InvalidLease as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    def _open_fd(self) -> int:
        """A new open file description of the arena: its slot locks are apart from every other holder's."""
        fd = os.open(self.shm.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not os.path.basename(self.shm.path).startswith(PREFIX):
            os.close(fd)
            raise ArenaError(f"{self.shm.path} is not this worker's arena")
        return fd

    async def _lock(self, locks: SlotLocks, slot: int, context) -> None:
        remaining = context.time_remaining()
        deadline = time.monotonic() + (self.idle_timeout if remaining is None else min(remaining, self.idle_timeout))
        delay = _LOCK_POLL_S[0]
        while not locks.try_lock(slot):
            if time.monotonic() > deadline:
                raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"slot {slot}'s writer lock was still held by another writer; nothing was written")
            await asyncio.sleep(delay)
            delay = min(2 * delay, _LOCK_POLL_S[1])

    async def _write(self, slot: int, pos: int, n: int, part: pb.KvPositions) -> int:
        size = len(part.data)
        if part.pos0 != pos:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"a KV part starts at position {part.pos0}; the next position is {pos}")
        if size == 0 or size % self.position_bytes:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"a KV part of {size} bytes is not a positive multiple of the layout's "
                           f"{self.position_bytes} bytes a position")
        end = pos + size // self.position_bytes
        if end > n:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"KV parts up to position {end} exceed the stream's {n} prompt tokens")
        try:
            await asyncio.to_thread(self.shm.arena.import_positions, slot, pos, [part.data])
        except ValueError as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"KV part refused: {e}") from None
        return end

    async def _seal(self, rid: str, lease, pos: int, n: int, seal: pb.KvPushSeal) -> int:
        if seal.n_tokens != n or pos != n:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"the seal is for {seal.n_tokens} positions; {pos} of the stream's {n} arrived; the slot "
                           "was left unsealed")
        arena = self.shm.arena
        checksum = await asyncio.to_thread(arena.checksum, lease.slot)
        if checksum != seal.checksum:
            raise _Refused(grpc.StatusCode.DATA_LOSS,
                           f"the K/V written into slot {lease.slot} has checksum {checksum:016x}, the prefill worker "
                           f"sealed {seal.checksum:016x}; the slot was left unsealed")
        await asyncio.to_thread(arena.seal, lease.slot, request_key(rid), lease.generation)
        return arena.header(lease.slot)["checksum"]
