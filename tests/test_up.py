"""splitgemma up: three processes start, serve a request, and stop cleanly on SIGTERM (gateway first), leaving
no process and no shared-memory file; a child that dies takes the others down and up fails."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from splitgemma.engine import Model

from tools.procs import SPLITGEMMA, LoggedProcess

FIX = Path(__file__).parent / "fixtures"
MODEL = FIX / "fastgemma" / "mini-e2b-tame" / "mini-e2b-tame.fgm"
TEMPLATE = FIX / "chat" / "chat-template-e2b.jinja"


def _children(pid: int) -> dict[int, str]:
    """pid → command line of every process whose parent is pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry)] = cmdline
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(shm_dir: Path, tmp_path: Path, *options: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    # up gets SIGTERM (and stops its children) if the tests die; it prints its URL on stdout when ready
    p = LoggedProcess([*SPLITGEMMA, "up", "--model", str(MODEL), "--port", "0",
                       "--max-context", "512", "--chunk", "64", *(options or ("--slots", "2", "--threads", "1")),
                       "--shm-dir", str(shm_dir), "--chat-template", str(TEMPLATE), "--drain-timeout", "5"],
                      tmp_path / "up.log", env=env, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 90
    line = b""
    while not line.endswith(b"\n"):
        assert time.monotonic() < deadline and p.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        if select.select([p.stdout], [], [], 0.2)[0]:
            line += os.read(p.stdout.fileno(), 4096)
    m = re.search(rb"serving mini-e2b-tame at (http://\S+/v1)", line)
    assert m, line
    return p, m.group(1).decode()


def test_up_serves_and_stops_cleanly(shm_dir, tmp_path):
    p, url = _start(shm_dir, tmp_path, "--slots", "2", "--threads", "1", "--prefill-metrics-port", "0",
                    "--decode-metrics-port", "0", "--lookup-k", "2", "--forced-tokens", "off")
    try:
        # Every process's metrics are reachable, with the vLLM names beside ours.
        urls = dict((kind, u) for u, kind in re.findall(r"(http://\S+/metrics) \((\w+)\)",
                                                        (tmp_path / "up.log").read_text()))
        assert set(urls) == {"gateway", "prefill", "decode"}
        for kind, u in urls.items():
            text = httpx.get(u, timeout=10).text
            assert f"splitgemma_{kind}" in text and "_created" not in text, (kind, text[:500])
        children = _children(p.pid)
        assert sorted(cmd.split()[3] for cmd in children.values()) == ["decode", "gateway", "prefill"]
        decode_cmd = next(cmd for cmd in children.values() if cmd.split()[3] == "decode")
        assert " --lookup-k 2 " in decode_cmd and " --forced-tokens off " in decode_cmd, decode_cmd
        assert any(f.name.startswith("splitgemma-kv-") for f in shm_dir.iterdir())
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        r = c.chat.completions.create(model="mini-e2b-tame", messages=[{"role": "user", "content": "w5 w6"}],
                                      max_tokens=4, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 4
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, (tmp_path / "up.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    log = (tmp_path / "up.log").read_text()
    assert "stopped (SIGTERM)" in log
    assert not any(_alive(pid) for pid in children), "a child outlived splitgemma up"
    assert list(shm_dir.iterdir()) == []
    # Ordered: the gateway finished before the workers were asked to stop.
    assert log.index("Application shutdown complete") < log.index('"msg": "draining"')
    # Each process says who it is, in the same scheme, the native core's backend line too.
    for service in ("splitgemma-gateway", "splitgemma-prefill", "splitgemma-decode"):
        assert f'"service": "{service}"' in log
    assert "splitgemma-prefill: GEMM backend" in log and "splitgemma-decode: GEMM backend" in log


@pytest.mark.parametrize("option", ["--port", "--decode-metrics-port"])
def test_up_on_a_taken_port_fails_before_loading_anything(tmp_path, option):
    """No --model: the default model would be fetched and converted first, were the port not checked before."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["SPLITGEMMA_CACHE"] = str(tmp_path / "empty-cache")  # anything loaded would show here
        r = subprocess.run([*SPLITGEMMA, "up", option, str(port), *(["--port", "0"] if option != "--port" else [])],
                           capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, r.stderr
    assert f"{option} {port}" in r.stderr and "another" in r.stderr, r.stderr
    assert not (tmp_path / "empty-cache").exists() and "GEMM backend" not in r.stderr


def test_up_refuses_a_draft_longer_than_the_decode_worker_takes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["SPLITGEMMA_CACHE"] = str(tmp_path / "empty-cache")
    r = subprocess.run([*SPLITGEMMA, "up", "--port", "0", "--lookup-k", "9"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 1 and "--lookup-k must be at most 8, got 9" in r.stderr, r.stderr
    assert not (tmp_path / "empty-cache").exists()


def test_up_fails_when_a_child_dies(shm_dir, tmp_path):
    p, url = _start(shm_dir, tmp_path)
    try:
        children = _children(p.pid)
        decode = next(pid for pid, cmd in children.items() if cmd.split()[3] == "decode")
        os.kill(decode, signal.SIGKILL)
        assert p.wait(60) == 1
    finally:
        if p.poll() is None:
            p.kill()
    log = (tmp_path / "up.log").read_text()
    assert "the decode worker exited unexpectedly (signal SIGKILL)" in log
    assert not any(_alive(pid) for pid in children)
    assert list(shm_dir.iterdir()) == [], "the dead worker's arena was swept"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--cores split needs 2 CPUs")
def test_up_passes_the_kv_budget_and_splits_the_cores(shm_dir, tmp_path):
    slot = Model(str(MODEL), threads=1, max_context=512, chunk=64, max_batch=1).kv_slot_bytes
    p, url = _start(shm_dir, tmp_path, "--kv-cache-bytes", str(3 * slot + 1), "--cores", "split")
    try:
        ready = httpx.get(url.removesuffix("/v1") + "/ready", timeout=10).json()
        assert ready["workers"]["decode"][0]["slots_total"] == 3
        children = {cmd.split()[3]: pid for pid, cmd in _children(p.pid).items()}
        cpus = sorted(os.sched_getaffinity(0))
        half = len(cpus) // 2
        # Pinned, and with no --threads each engine's pool is its own share of the CPUs.
        assert os.sched_getaffinity(children["decode"]) == set(cpus[:half])
        assert os.sched_getaffinity(children["prefill"]) == set(cpus[half:])
        assert os.sched_getaffinity(children["gateway"]) == set(cpus)
        log = (tmp_path / "up.log").read_text()
        ready_line = next(line for line in log.splitlines() if '"decode worker ready"' in line)
        assert f'"threads": {half}' in ready_line
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
