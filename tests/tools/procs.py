"""Service processes for the tests: free loopback ports, starting processes that die with the test process,
waiting until they answer, stopping them, and private shared-memory folders for their KV arenas."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitgemma.serving.ports import free_ports  # noqa: F401 - the tests' port picker, re-exported
from splitgemma.v1 import serving_pb2 as pb

# Runs the command after it with PR_SET_PDEATHSIG set to SIGTERM, which survives exec: a killed test run leaves no
# servers behind, and the pid stays the command's. Not a preexec_fn: with one, subprocess runs Python's at-fork
# handlers in the child, and gRPC's abort there while this process has gRPC threads (channels, an in-test OTLP/gRPC
# receiver); without one the child runs no Python before exec (subprocess spawns it with vfork).
DIE_WITH_PARENT = [sys.executable, "-c", "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                   "os.execvp(sys.argv[1], sys.argv[1:])"]
SPLITGEMMA = [sys.executable, "-m", "splitgemma"]


def shm_folder(tag: str) -> Path:
    """A new private folder on /dev/shm (tmpfs, where the services keep their KV arenas), or in the temporary
    directory where /dev/shm is not writable. The caller removes it."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=f"sg-test-{tag}-", dir=base))


@contextmanager
def private_shm(tag: str) -> Iterator[Path]:
    """shm_folder(tag), removed with whatever is left in it on leaving."""
    d = shm_folder(tag)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class LoggedProcess(subprocess.Popen):
    """`argv` started with DIE_WITH_PARENT, no stdin, stderr (and stdout unless given) to the file `log`."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None, stdout=None):
        self.log_path = Path(log)
        with open(self.log_path, "wb") as f:
            super().__init__([*DIE_WITH_PARENT, *map(str, argv)], env=env, stdin=subprocess.DEVNULL,
                             stdout=f if stdout is None else stdout, stderr=f)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_until(ready: Callable[[], bool], what: str, timeout: float,
               watch: Mapping[str, LoggedProcess] | None = None, interval: float = 0.1) -> None:
    """Polls ready() every `interval` s until it is true. Fails (AssertionError with the logs) when a process in
    `watch` exits first, or after `timeout` s."""
    watch = watch or {}
    deadline = time.monotonic() + timeout
    while True:
        for name, p in watch.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited with {p.returncode}:\n{p.log()[-3000:]}")
        if ready():
            return
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {name}\n{p.log()[-1500:]}" for name, p in watch.items())
            raise AssertionError(f"{what} not ready after {timeout:.0f} s\n{logs}")
        time.sleep(interval)


def http_ready(url: str) -> bool:
    """The gateway at `url` answers /ready with 200."""
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def grpc_serving(channel: grpc.Channel) -> bool:
    """The gRPC health service on `channel` says SERVING (for the whole server)."""
    try:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
    except grpc.RpcError:
        return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def wait_decode_idle(stats: Callable[[], pb.DecodeStats], timeout: float) -> pb.DecodeStats:
    """A decode worker's DecodeStats (from `stats`) once no slot is leased, running or quarantined."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats()
        if s.slots_leased == s.slots_running == s.slots_quarantined == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"slots still in use after {timeout} s: {s}")
        time.sleep(0.02)


def terminate(procs: Iterable[subprocess.Popen], timeout: float) -> None:
    """SIGTERM to each process still running, then up to `timeout` s for each to exit before a SIGKILL."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
