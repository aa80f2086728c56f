"""The decode worker's KV arena in shared memory, and the prefill worker's view of it.

The arena is one plain file under /dev/shm (or another directory given to both workers), named
``splitgemma-kv-<worker id>``, holding ``n_slots × Model.kv_slot_bytes`` bytes: exactly the slots, so the file
size alone says the geometry. Beside it, ``splitgemma-kv-<worker id>.owner`` records who owns it.

Why not multiprocessing.shared_memory: on Python < 3.13 every process that attaches registers the segment with a
resource tracker, which unlinks it when that process exits, while the owner still uses it (CPython gh-82300).
Plain files give us explicit control:

* Created exclusively (O_CREAT | O_EXCL, mode 0600, O_NOFOLLOW): two workers never share a file by accident.
* Fully allocated at start with posix_fallocate: tmpfs allocates lazily, so an arena larger than the free space
  of /dev/shm (Docker's default is 64 MiB) would otherwise map fine and kill the process with SIGBUS on the
  first write to a missing page, much later. Here the start fails with the required and free byte counts.
* Ownership: the owner creates the sidecar first (exclusively), holds an exclusive flock on it for its whole
  life and writes its pid, the pid's start time, the pid namespace and the boot id into it. A SIGKILLed owner
  cannot unlink anything, but the kernel drops its lock; the next owner's start sweeps every file of the prefix
  whose owner is gone (lock free and the recorded process not running, or another boot). The lock is what
  decides: it is right across containers that share /dev/shm but not a pid namespace; the pid record covers the
  instant between creating the sidecar and locking it, and names the owner in messages.
* Clean shutdown unlinks the arena, then the sidecar (creation order reversed, so an arena never exists without
  its owner record).

The prefill worker opens an existing arena by path, read-write: the path must be a ``splitgemma-kv-*`` file
directly in the directory it was told to trust, must not be a symlink, and its size must equal
``n_slots × slot_bytes`` of the lease and of its own model's slot layout.

Who may write a slot (SlotLocks): a prefill holds the slot's writer lock — an open-file-description lock on the
slot's first byte of the arena file — for as long as it writes, and writes only if the slot header's lease stamp
(KvArena.stamp_lease, set by the decode worker when it leases the slot) is its lease's generation and the digest of
its lease's secret (lease_digest: the header never holds a secret, see there). The decode
worker hands a slot out again only after taking that lock itself (without waiting) and clearing the stamp. So a
prefill whose lease was released or expired either finishes the chunk it is writing before the slot changes hands,
or finds the stamp cleared and writes nothing; there is no window in which a late chunk can land in the next
owner's K/V. OFD locks (not POSIX record locks) belong to the open file, not the process, so closing another
descriptor of the file does not drop them, and the kernel drops them when the holder dies: a killed prefill never
pins a slot. They work across containers that share the file (one /dev/shm).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import logging
import mmap
import os
import re
import stat
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from splitgemma.engine import KvArena, Model, huge_mapped_bytes

PREFIX = "splitgemma-kv-"
OWNER_SUFFIX = ".owner"
DEFAULT_DIR = "/dev/shm"
# An owner record younger than this with no lock held and no readable content is a worker between creating
# its sidecar and locking it: leave it alone.
_CREATING_GRACE_S = 10.0
_WORKER_ID = re.compile(r"[A-Za-z0-9_.-]{1,100}")

log = logging.getLogger("splitgemma.shm_arena")


class ArenaError(OSError):
    """The arena cannot be created or opened (no space, bad path, wrong size, live owner, …): message only."""


class ArenaMissing(ArenaError):
    """The arena file named by a lease does not exist (its decode worker has gone)."""


class InvalidLease(ValueError):
    """A lease without a well-formed secret: message only (the RPC answers INVALID_ARGUMENT)."""


def request_key(request_id: str) -> int:
    """The u64 stamped into the slot header for a request id string: the first 8 bytes (little-endian) of
    BLAKE2b-64 over its UTF-8 bytes. Prefill seals with it, decode verifies with it."""
    return int.from_bytes(hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest(), "little")


LEASE_SECRET_BYTES = 32  # Lease.secret: 256 random bits per reservation (secrets.token_bytes)
_LEASE_PERSON = b"splitgemma-lease"  # BLAKE2b personalisation: these digests mean nothing elsewhere


def lease_digest(worker_id: str, slot: int, generation: int, secret: bytes) -> bytes:
    """What the decode worker stamps into a leased slot's header, and what a prefill worker recomputes from the lease
    it was given: BLAKE2b-256 keyed with the lease's secret over the worker id, slot and generation.

    Why a keyed digest and not the secret itself: every process that maps the arena can read the header (each prefill
    worker, anything sharing the /dev/shm), and the secret also authorises Generate and Release at the decode worker.
    A header holding the secret would hand that capability to every reader; the digest proves a presented secret
    without revealing it (finding a secret that yields a given 256-bit digest is a preimage search). Keying it with
    the secret over (worker id, slot, generation) binds the secret to that one lease: the same secret under another
    slot or generation yields another digest. Raises InvalidLease for a secret of the wrong size."""
    if len(secret) != LEASE_SECRET_BYTES:
        raise InvalidLease(f"the lease's secret must be {LEASE_SECRET_BYTES} bytes, got {len(secret)} (a lease from "
                           "Decode.Reserve carries one; forward it unchanged)")
    message = struct.pack("<IQ", slot, generation) + worker_id.encode("utf-8")
    return hashlib.blake2b(message, key=secret, digest_size=32, person=_LEASE_PERSON).digest()


NO_LEASE = bytes(32)  # the digest stamped with generation 0: no lease may write the slot


def arena_path(directory: str, worker_id: str) -> str:
    if not _WORKER_ID.fullmatch(worker_id):
        raise ArenaError(f"worker id {worker_id!r} must be 1-100 characters of A-Z a-z 0-9 _ . -")
    return os.path.join(directory, PREFIX + worker_id)


# ---------------------------------------------------------------------------------------------------------------
# Owner records


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), None if no such
    process. Together with the pid it identifies a process: pids are reused, start times are not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _owner_record(worker_id: str, size: int) -> dict:
    pid = os.getpid()
    return {"pid": pid, "start_ticks": _start_ticks(pid), "pid_ns": _pid_namespace(), "boot_id": _boot_id(),
            "worker_id": worker_id, "bytes": size, "created_unix": time.time()}


def owner_status(sidecar: str) -> tuple[bool, str]:
    """(alive, why) for the owner named by the sidecar file `sidecar`."""
    try:
        fd = os.open(sidecar, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False, "owner record gone"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, "its owner holds the lock"
        fcntl.flock(fd, fcntl.LOCK_UN)
        raw = os.read(fd, 4096)
        age = time.time() - os.fstat(fd).st_mtime
    finally:
        os.close(fd)
    try:
        rec = json.loads(raw)
        pid = int(rec["pid"])
    except (ValueError, KeyError, TypeError):
        if age < _CREATING_GRACE_S:
            return True, "owner record being written"
        return False, "unreadable owner record and no lock"
    if rec.get("boot_id") and rec["boot_id"] != _boot_id():
        return False, f"pid {pid} ran in a previous boot"
    if rec.get("pid_ns") == _pid_namespace() and rec.get("start_ticks") is not None \
            and _start_ticks(pid) == rec["start_ticks"]:
        # Lock free but the very process still runs: it must have lost its lock fd; never take a live file.
        return True, f"pid {pid} still runs"
    return False, f"pid {pid} is gone and holds no lock"


def sweep(directory: str = DEFAULT_DIR) -> list[str]:
    """Remove every arena (and owner record) of our prefix in `directory` whose owner is dead. Returns the
    paths removed. Files of other users, symlinks and live owners' files are left alone."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    uid = os.getuid()
    for name in sorted(names):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            continue
        if name.endswith(OWNER_SUFFIX):
            alive, why = owner_status(path)
            if alive:
                continue
            victims = [path[: -len(OWNER_SUFFIX)], path]  # the arena first: never an arena without a record
        elif not os.path.lexists(path + OWNER_SUFFIX):
            why, victims = "no owner record", [path]
        else:
            continue  # judged through its owner record
        for v in victims:
            try:
                os.unlink(v)
            except FileNotFoundError:
                continue
            removed.append(v)
            log.warning("swept stale KV arena file", extra={"path": v, "reason": why})
    return removed


# ---------------------------------------------------------------------------------------------------------------
# The owner side (decode worker)


class SlotLocks:
    """The slots' writer locks (module doc) on one open file description of an arena. The file stays open as long
    as this object lives (a prefill's view may outlive its cache entry while a run still holds a lock)."""

    _FLOCK = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padding

    def __init__(self, fd: int, slot_bytes: int):
        self._file = io.FileIO(fd, "r+", closefd=True)
        self.slot_bytes = slot_bytes

    def _op(self, cmd: int, kind: int, slot: int) -> None:
        fcntl.fcntl(self._file.fileno(), cmd, struct.pack(self._FLOCK, kind, os.SEEK_SET, slot * self.slot_bytes, 1, 0))

    def try_lock(self, slot: int) -> bool:
        """Take the slot's writer lock if no one holds it; False (at once) when someone does."""
        try:
            self._op(fcntl.F_OFD_SETLK, fcntl.F_WRLCK, slot)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def is_locked(self, slot: int) -> bool:
        """Does another open file description hold the slot's writer lock? Only looks (F_OFD_GETLK): a writer
        that wants the lock right now is not delayed."""
        got = fcntl.fcntl(self._file.fileno(), fcntl.F_OFD_GETLK,
                          struct.pack(self._FLOCK, fcntl.F_WRLCK, os.SEEK_SET, slot * self.slot_bytes, 1, 0))
        return struct.unpack(self._FLOCK, got)[0] != fcntl.F_UNLCK

    def unlock(self, slot: int) -> None:
        self._op(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, slot)

    @contextmanager
    def held(self, slot: int) -> Iterator[None]:
        """Hold the slot's writer lock, waiting for a writer that still holds it."""
        self._op(fcntl.F_OFD_SETLKW, fcntl.F_WRLCK, slot)  # Python retries it on EINTR (PEP 475)
        try:
            yield
        finally:
            self.unlock(slot)

    def close(self) -> None:
        self._file.close()


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in `directory` (tmpfs: what is left of its size)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _huge_pages(buf: mmap.mmap) -> bool | None:
    """Whether the arena's memory comes in 2 MB pages (None: cannot tell). Its first page is read to map it: a
    tmpfs gives an arena huge pages when mounted huge=within_size|always, or under the host's shmem_enabled "force";
    /dev/shm rarely is."""
    buf[0]  # noqa: B018 (a read maps the page)
    huge = huge_mapped_bytes(buf)
    return None if huge is None else huge > 0


def _space_message(directory: str, need: int, free: int, n_slots: int, slot_bytes: int) -> str:
    return (f"not enough shared memory for the KV arena in {directory}: {need:,} bytes required "
            f"({n_slots} slots × {slot_bytes:,} bytes), {free:,} bytes free. Use fewer --slots, a smaller "
            f"--kv-cache-bytes or --max-context, or give the container more /dev/shm (docker: --shm-size / compose: shm_size)")


class ShmArena:
    """The decode worker's arena: create with ShmArena.create(...), use .arena (a KvArena), close() at the end."""

    def __init__(self, path: str, worker_id: str, n_slots: int, slot_bytes: int, buf: mmap.mmap, arena: KvArena,
                 owner_fd: int, locks: SlotLocks):
        self.path = path
        self.worker_id = worker_id
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.arena = arena
        self.locks = locks
        self._buf = buf
        self._owner_fd = owner_fd

    def stamp_lease(self, slot: int, generation: int, secret: bytes) -> None:
        """Let the prefill of the lease (generation, secret) write the slot (only a free slot, which no one writes, is
        stamped)."""
        self.arena.stamp_lease(slot, generation, lease_digest(self.worker_id, slot, generation, secret))

    def revoke(self, slot: int) -> bool:
        """Take the slot back from its lease: True once no prefill writes it and none can start (the stamp is
        cleared under the slot's writer lock); False, without waiting, while a prefill still holds the lock."""
        if not self.locks.try_lock(slot):
            return False
        try:
            self.arena.stamp_lease(slot, 0, NO_LEASE)
        finally:
            self.locks.unlock(slot)
        return True

    def writing(self, slot: int) -> bool:
        """Is a prefill holding the slot's writer lock (writing its K/V, or about to)?"""
        return self.locks.is_locked(slot)

    @property
    def owner_path(self) -> str:
        return self.path + OWNER_SUFFIX

    @property
    def size(self) -> int:
        return self.n_slots * self.slot_bytes

    @classmethod
    def create(cls, model: Model, n_slots: int, worker_id: str, directory: str = DEFAULT_DIR) -> "ShmArena":
        if n_slots < 1:
            raise ArenaError(f"the arena needs at least 1 slot, got {n_slots}")
        path = arena_path(directory, worker_id)
        if not os.path.isdir(directory):
            raise ArenaError(f"shared-memory directory {directory} does not exist")
        sweep(directory)
        slot_bytes = model.kv_slot_bytes
        size = n_slots * slot_bytes
        owner = path + OWNER_SUFFIX
        try:
            owner_fd = os.open(owner, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            _, why = owner_status(owner)
            raise ArenaError(f"{path} is in use by a live worker with the same id ({why}); choose another "
                             "worker id") from None
        fd = -1
        try:
            fcntl.flock(owner_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(owner_fd, json.dumps(_owner_record(worker_id, size)).encode())
            free = free_bytes(directory)
            if free < size:
                raise ArenaError(_space_message(directory, size, free, n_slots, slot_bytes))
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise
                raise ArenaError(_space_message(directory, size, free_bytes(directory), n_slots,
                                                slot_bytes)) from None
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            arena = KvArena(model, buf, n_slots)
        except BaseException:
            if fd >= 0:
                os.close(fd)
                _unlink_quietly(path)
            _unlink_quietly(owner)
            os.close(owner_fd)
            raise
        huge = _huge_pages(buf)
        log.info("created KV arena", extra={"path": path, "slots": n_slots, "slot_bytes": slot_bytes,
                                            "bytes": size, "huge_pages": huge})
        if huge is False:
            log.info(f"the KV arena is on 4 KB pages: decode reads every sequence's K/V from it each step, and on 2 MB "
                     f"pages a KVM guest read them up to 2x faster (docs/benchmarks.md, session 23); for those, "
                     f"give --shm-dir a tmpfs mounted with huge=within_size (now {directory})")
        # The owner lock stays on owner_fd; fd carries the slots' writer locks (SlotLocks).
        return cls(path, worker_id, n_slots, slot_bytes, buf, arena, owner_fd, SlotLocks(fd, slot_bytes))

    def close(self) -> None:
        """Unlink the arena and its owner record (idempotent). The memory stays mapped until the last user drops
        it (the engine may still hold the KvArena), but no new process can open it."""
        if self._owner_fd < 0:
            return
        _unlink_quietly(self.path)
        _unlink_quietly(self.owner_path)
        os.close(self._owner_fd)
        self._owner_fd = -1
        self.locks.close()
        log.info("unlinked KV arena", extra={"path": self.path})

    def __enter__(self) -> "ShmArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# The user side (prefill worker)


@dataclass
class MappedArena:
    """An arena of another process, mapped read-write. `identity` (device, inode) tells a later file at the same
    path (a restarted decode worker) from this one."""
    path: str
    identity: tuple[int, int]
    n_slots: int
    slot_bytes: int
    arena: KvArena
    buf: mmap.mmap
    locks: SlotLocks

    def still_current(self) -> bool:
        """Is the file at `path` still the one mapped (not unlinked, not replaced)?"""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.identity


def open_shared_arena(model: Model, path: str, n_slots: int, slot_bytes: int,
                      directory: str = DEFAULT_DIR) -> MappedArena:
    """Map the arena file `path` (named by a lease) for writing K/V with `model`. Raises ArenaMissing when the
    file does not exist and ArenaError for a path outside `directory`, a symlink, a file that is not an arena
    of our prefix, or a geometry that does not match the lease or the model's slot layout."""
    if not os.path.isabs(path):
        raise ArenaError(f"arena path {path!r} is not absolute")
    name = os.path.basename(path)
    if not name.startswith(PREFIX) or name.endswith(OWNER_SUFFIX) or not _WORKER_ID.fullmatch(name[len(PREFIX):]):
        raise ArenaError(f"{path} is not a splitgemma KV arena (its name must be {PREFIX}<worker id>)")
    if os.path.realpath(os.path.dirname(path)) != os.path.realpath(directory):
        raise ArenaError(f"arena {path} is outside the shared-memory directory this worker trusts ({directory})")
    if n_slots < 1:
        raise ArenaError(f"the lease names an arena of {n_slots} slots")
    if slot_bytes != model.kv_slot_bytes:
        raise ArenaError(f"the lease's slots are {slot_bytes:,} bytes; this model's slot layout needs "
                         f"{model.kv_slot_bytes:,} (different model, --max-context or --chunk)")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ArenaMissing(f"arena {path} does not exist (its decode worker has gone)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ArenaError(f"arena {path} is a symlink; refusing to follow it") from None
        raise ArenaError(f"cannot open arena {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArenaError(f"arena {path} is not a regular file")
        want = n_slots * slot_bytes
        if st.st_size != want:
            raise ArenaError(f"arena {path} is {st.st_size:,} bytes; the lease says {n_slots} slots × "
                             f"{slot_bytes:,} = {want:,}")
        buf = mmap.mmap(fd, want, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return MappedArena(path, (st.st_dev, st.st_ino), n_slots, slot_bytes, KvArena(model, buf, n_slots), buf,
                       SlotLocks(fd, slot_bytes))
