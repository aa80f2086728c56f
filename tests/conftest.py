"""Shared pytest fixtures: the fixture folders, .fgm files made by the project's converter (with a staleness check
against the digest tests/tools/make_fixtures.py recorded), the kernel backends this CPU can run, and private
shared-memory folders for the services' KV arenas."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tools.fgm_decode import FgmReader

FIXTURES = Path(__file__).parent / "fixtures"
# fastgemma's tiny checkpoints with the .fgm its own converter made (an oracle we did not write)
FASTGEMMA = {name: FIXTURES / "fastgemma" / name for name in ("mini-e2b", "mini-e2b-tame")}
# ours, made by tests/tools/make_fixtures.py with transformers
OURS = {name: FIXTURES / name for name in ("g4-e2b", "g4-e2b-sharp", "g4-e4b")}
ALL_CHECKPOINTS = {**FASTGEMMA, **OURS}
FASTGEMMA_GROUP = 256  # fastgemma converted its checkpoints with --weights both --group 256 (their README.txt)
BACKENDS = ("amx", "vnni", "avx2")
_CPU_FLAG = {"amx": "amx_int8", "vnni": "avx512_vnni", "avx2": "avx2"}


def fastgemma_fgm(name: str) -> Path:
    """fastgemma's own conversion of its checkpoint `name`."""
    return FASTGEMMA[name] / f"{name}.fgm"


def convert(src: Path, out: Path, group: int) -> Path:
    from splitgemma.fgm.convert import convert_checkpoint

    convert_checkpoint(src, out, weights="dual", group=group, progress=False)
    return out


@pytest.fixture(scope="session")
def converted_fgm(tmp_path_factory):
    """name -> path of the .fgm the project's converter makes of checkpoint `name` (once per session).

    For our fixtures the conversion uses the recorded group and must reproduce the recorded tensor digest: the
    fgm_* reference logits were computed from exactly those tensors. fastgemma's checkpoints are converted with
    fastgemma's group (no digest: no reference depends on our conversion of them).
    """
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name in cache:
            return cache[name]
        src = ALL_CHECKPOINTS[name]
        out = tmp_path_factory.mktemp(name) / f"{name}.fgm"
        if name in OURS:
            ref = np.load(src / "reference.npz")
            convert(src, out, int(ref["fgm_group"]))
            got, want = FgmReader(out).tensor_sha256(), str(ref["fgm_tensor_sha256"])
            if got != want:
                pytest.fail(f"{name}: fixture stale: re-run tests/tools/make_fixtures.py (the converter now makes "
                            f"tensors with digest {got}, the fgm_* references were made from {want})")
        else:
            convert(src, out, FASTGEMMA_GROUP)
        cache[name] = out
        return out

    return get


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def backend_unavailable(backend: str) -> str | None:
    """Why `backend` cannot run here, or None if it can. Asks the kernels (which know what is implemented) when
    they are built in, otherwise the CPU flags."""
    flag = _CPU_FLAG[backend]
    has_flag = flag in _cpu_flags()
    try:
        from splitgemma._native import kernels
    except ImportError:
        kernels = None
    if kernels is not None and hasattr(kernels, "cpu_supports"):
        if kernels.cpu_supports(backend):
            return None
        return (f"backend {backend} cannot run here: kernels.cpu_supports({backend!r}) is False "
                f"(CPU flag {flag} {'present' if has_flag else 'absent'})")
    return None if has_flag else f"backend {backend} needs CPU flag {flag}, which this CPU lacks"


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Parametrises a test over amx/vnni/avx2, skipping (with the reason) those this CPU cannot run. Sets
    FGM_BACKEND for code that reads it (e.g. a subprocess); in-process calls should pass the name explicitly."""
    reason = backend_unavailable(request.param)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("FGM_BACKEND", request.param)
    return request.param


@pytest.fixture
def shm_dir(request):
    """A private folder for the KV arenas of the services one test starts, removed afterwards."""
    from tools.procs import private_shm  # not at the top: it imports gRPC, which most tests do not need
    with private_shm(request.module.__name__) as d:
        yield d


# Measured numbers (quantisation errors, oracle agreement) for the docs: shown in the terminal summary with -v.
_REPORT: list[str] = []


@pytest.fixture(scope="session")
def report():
    return _REPORT.append


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _REPORT and config.getoption("verbose") > 0:
        terminalreporter.section("measured numbers")
        for line in _REPORT:
            terminalreporter.write_line(line)
