"""The shared-memory KV arena (splitgemma/serving/shm_arena.py): exclusive creation, full allocation with a clear
error when the space is missing, the sweep of files left by SIGKILLed owners (and never of a live owner's), and
the prefill side's validated open."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from splitgemma.engine import Model
from splitgemma.serving import shm_arena
from splitgemma.serving.shm_arena import (OWNER_SUFFIX, PREFIX, ArenaError, ArenaMissing, ShmArena,
                                          open_shared_arena, owner_status, request_key, sweep)

FGM = Path(__file__).parent / "fixtures" / "fastgemma" / "mini-e2b-tame" / "mini-e2b-tame.fgm"


@pytest.fixture(scope="module")
def model():
    return Model(str(FGM), threads=1, max_context=128, chunk=32, max_batch=4)


@pytest.fixture
def shm_dir(shm_dir):
    """conftest's private folder (on tmpfs, as /dev/shm is in production) as the str the arena API takes."""
    return str(shm_dir)


def _files(d: str) -> list[str]:
    return sorted(os.listdir(d))


def _owner_process(shm_dir: str, worker: str) -> subprocess.Popen:
    """Another process that creates an arena and keeps it until killed; returns once the arena exists."""
    code = textwrap.dedent(f"""
        import sys, time
        from splitgemma.engine import Model
        from splitgemma.serving.shm_arena import ShmArena
        m = Model({str(FGM)!r}, threads=1, max_context=128, chunk=32, max_batch=4)
        a = ShmArena.create(m, 2, {worker!r}, {shm_dir!r})
        print(a.path, flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if not line:
        p.kill()
        raise AssertionError("owner process failed: " + p.stderr.read())
    return p


def test_request_key_is_blake2b64_little_endian():
    # The mapping is part of the wire contract (proto comment): prefill and decode must compute the same u64.
    assert request_key("") == int.from_bytes(hashlib.blake2b(b"", digest_size=8).digest(), "little")
    assert request_key("cmpl-1") == int.from_bytes(hashlib.blake2b(b"cmpl-1", digest_size=8).digest(), "little")
    assert request_key("cmpl-1") != request_key("cmpl-2")
    assert request_key("é") == int.from_bytes(hashlib.blake2b("é".encode(), digest_size=8).digest(), "little")


def test_create_is_exclusive_allocated_and_unlinked(model, shm_dir):
    a = ShmArena.create(model, 3, "w1", shm_dir)
    try:
        assert a.path == os.path.join(shm_dir, PREFIX + "w1")
        st = os.stat(a.path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and stat.S_IMODE(os.stat(a.owner_path).st_mode) == 0o600
        assert st.st_size == 3 * model.kv_slot_bytes
        assert st.st_blocks * 512 >= st.st_size  # allocated up front, not sparse
        rec = json.loads(Path(a.owner_path).read_text())
        assert rec["pid"] == os.getpid() and rec["worker_id"] == "w1" and rec["boot_id"]
        # A second owner with the same id is refused, and the live files stay.
        with pytest.raises(ArenaError, match="in use by a live worker"):
            ShmArena.create(model, 3, "w1", shm_dir)
        assert _files(shm_dir) == [PREFIX + "w1", PREFIX + "w1" + OWNER_SUFFIX]
        # The arena works: prefill writes, seal, verify.
        model.prefill(a.arena, 1, [5, 6, 7])
        a.arena.seal(1, request_key("r"), 9)
        a.arena.verify(1, request_key("r"), 9)
    finally:
        a.close()
    assert _files(shm_dir) == []
    a.close()  # idempotent


def test_bad_worker_id_and_slot_count(model, shm_dir):
    with pytest.raises(ArenaError, match="worker id"):
        ShmArena.create(model, 1, "../x", shm_dir)
    with pytest.raises(ArenaError, match="at least 1 slot"):
        ShmArena.create(model, 0, "w", shm_dir)
    with pytest.raises(ArenaError, match="does not exist"):
        ShmArena.create(model, 1, "w", os.path.join(shm_dir, "nope"))


def test_too_large_fails_at_start_with_required_and_free_bytes(model, shm_dir):
    n = 10 ** 7  # ~2.5 TB: more than any /dev/shm here
    with pytest.raises(ArenaError) as e:
        ShmArena.create(model, n, "big", shm_dir)
    msg = str(e.value)
    assert f"{n * model.kv_slot_bytes:,} bytes required" in msg and "bytes free" in msg and "shm_size" in msg
    assert _files(shm_dir) == []  # nothing left behind


@pytest.fixture
def tiny_tmpfs():
    """A 1 MiB tmpfs, like an undersized container /dev/shm (needs the right to mount)."""
    d = tempfile.mkdtemp(prefix="sg-test-tiny-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or 'not permitted'})")
    yield d
    subprocess.run(["umount", d], check=True)
    os.rmdir(d)


def test_small_tmpfs_statvfs_check(model, tiny_tmpfs):
    n = (2 << 20) // model.kv_slot_bytes + 1  # > 2 MiB on a 1 MiB tmpfs
    with pytest.raises(ArenaError, match=r"bytes required .* bytes free"):
        ShmArena.create(model, n, "w", tiny_tmpfs)
    assert _files(tiny_tmpfs) == []


def test_small_tmpfs_fallocate_enospc(model, tiny_tmpfs, monkeypatch):
    # Free space can vanish between the check and the allocation (another process): posix_fallocate is what
    # guarantees no SIGBUS later. Make the check pass to reach it.
    real = os.statvfs
    calls = []

    def lying_statvfs(path):
        calls.append(path)
        st = real(path)
        if len(calls) > 1:
            return st
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, 1 << 40, st.f_files,
                                  st.f_ffree, st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(shm_arena.os, "statvfs", lying_statvfs)
    n = (2 << 20) // model.kv_slot_bytes + 1
    with pytest.raises(ArenaError, match=r"bytes required .* bytes free"):
        ShmArena.create(model, n, "w", tiny_tmpfs)
    assert len(calls) == 2
    assert _files(tiny_tmpfs) == []


def test_sweep_removes_a_sigkilled_owners_files(model, shm_dir):
    p = _owner_process(shm_dir, "dead")
    assert _files(shm_dir) == [PREFIX + "dead", PREFIX + "dead" + OWNER_SUFFIX]
    assert owner_status(os.path.join(shm_dir, PREFIX + "dead" + OWNER_SUFFIX))[0]
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    alive, why = owner_status(os.path.join(shm_dir, PREFIX + "dead" + OWNER_SUFFIX))
    assert not alive and "gone" in why
    # The next owner's start sweeps them; its own files are the only ones left.
    a = ShmArena.create(model, 1, "next", shm_dir)
    try:
        assert _files(shm_dir) == [PREFIX + "next", PREFIX + "next" + OWNER_SUFFIX]
    finally:
        a.close()


def test_sweep_leaves_a_live_owners_files(model, shm_dir):
    p = _owner_process(shm_dir, "live")
    try:
        mine = ShmArena.create(model, 1, "me", shm_dir)
        assert sweep(shm_dir) == []
        assert _files(shm_dir) == sorted([PREFIX + "live", PREFIX + "live" + OWNER_SUFFIX,
                                          PREFIX + "me", PREFIX + "me" + OWNER_SUFFIX])
        mine.close()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    assert sorted(sweep(shm_dir)) == sorted([os.path.join(shm_dir, PREFIX + "live"),
                                             os.path.join(shm_dir, PREFIX + "live" + OWNER_SUFFIX)])
    assert _files(shm_dir) == []


def test_owner_records_without_lock(shm_dir):
    # The pid record decides when no lock is held: a running process (same start time) is alive, an exited one
    # or one from another boot is not; an empty fresh record is an owner still being created.
    side = os.path.join(shm_dir, PREFIX + "x" + OWNER_SUFFIX)
    me = shm_arena._owner_record("x", 1)
    Path(side).write_text(json.dumps(me))
    assert owner_status(side) == (True, f"pid {os.getpid()} still runs")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    Path(side).write_text(json.dumps({**me, "pid": int(done.stdout)}))
    assert not owner_status(side)[0]
    Path(side).write_text(json.dumps({**me, "boot_id": "another-boot"}))
    assert owner_status(side) == (False, f"pid {os.getpid()} ran in a previous boot")
    Path(side).write_text("")
    assert owner_status(side) == (True, "owner record being written")
    old = time.time() - 3600
    os.utime(side, (old, old))
    assert not owner_status(side)[0]
    # An arena without an owner record belongs to nobody.
    Path(shm_dir, PREFIX + "orphan").write_bytes(b"\0" * 64)
    assert sorted(sweep(shm_dir)) == sorted([os.path.join(shm_dir, PREFIX + "orphan"), side])


def test_sweep_ignores_other_names_and_symlinks(shm_dir):
    Path(shm_dir, "other-file").write_text("x")
    os.symlink("/etc/hostname", os.path.join(shm_dir, PREFIX + "link"))
    assert sweep(shm_dir) == []
    assert _files(shm_dir) == sorted(["other-file", PREFIX + "link"])


def test_open_shared_arena_validation(model, shm_dir):
    a = ShmArena.create(model, 2, "own", shm_dir)
    sb = model.kv_slot_bytes
    try:
        with pytest.raises(ArenaError, match="not absolute"):
            open_shared_arena(model, os.path.relpath(a.path), 2, sb, shm_dir)
        with pytest.raises(ArenaError, match="not a splitgemma KV arena"):
            open_shared_arena(model, a.owner_path, 2, sb, shm_dir)
        other = tempfile.mkdtemp(prefix="sg-test-other-")
        try:
            shutil.copy(a.path, os.path.join(other, PREFIX + "own"))
            with pytest.raises(ArenaError, match="outside the shared-memory directory"):
                open_shared_arena(model, os.path.join(other, PREFIX + "own"), 2, sb, shm_dir)
        finally:
            shutil.rmtree(other)
        link = os.path.join(shm_dir, PREFIX + "link")
        os.symlink(a.path, link)
        with pytest.raises(ArenaError, match="symlink"):
            open_shared_arena(model, link, 2, sb, shm_dir)
        os.unlink(link)
        with pytest.raises(ArenaError, match=rf"is {2 * sb:,} bytes; the lease says 3 slots"):
            open_shared_arena(model, a.path, 3, sb, shm_dir)
        with pytest.raises(ArenaError, match="slot layout needs"):
            open_shared_arena(model, a.path, 2, sb + 64, shm_dir)
        with pytest.raises(ArenaMissing, match="does not exist"):
            open_shared_arena(model, os.path.join(shm_dir, PREFIX + "gone"), 2, sb, shm_dir)

        # The good case: what the other side writes through its own mapping, the owner verifies.
        view = open_shared_arena(model, a.path, 2, sb, shm_dir)
        prompt = np.arange(4, 44)
        model.prefill(view.arena, 1, prompt)
        view.arena.seal(1, request_key("req"), 77)
        a.arena.verify(1, request_key("req"), 77)
        assert a.arena.header(1)["n_tokens"] == 40
        with pytest.raises(ValueError, match="stale lease"):
            a.arena.verify(1, request_key("req"), 78)
        assert view.still_current()
    finally:
        a.close()
    assert not view.still_current()
