#!/usr/bin/env python3
"""The network KV transport beside shared memory, on loopback: time to first token, decode tokens per second and
bytes on the wire per prompt token (splitgemma/serving/kv_transport.py).

    python bench/bench_kv_transport.py                     # E2B (the shared random model), prompts of 512 and 2048
    python bench/bench_kv_transport.py --model tests/fixtures/fastgemma/mini-e2b-tame/mini-e2b-tame.fgm

One prefill worker and two decode workers, real processes on 127.0.0.1: `shm` shares the prefill worker's
--shm-dir (the prefill maps its arena), `network` has a folder of its own (only Decode.PushKv can reach it). For each
prompt length the two arms run alternately (shm, network, shm, …; --repeats each), each a fresh prompt (no prefix
cache hit): Reserve → Prefill → Generate of --max-tokens with ignore_eos, through gRPC as the gateway calls it.
TTFT = Reserve sent to the first token (the first Generate event); handoff = TTFT minus the prefill worker's own
prefill_seconds (first chunk to seal): Reserve, the K/V's last part and the seal, Generate's verify, the first event,
which is where the transport shows when the load's noise swamps the prefill itself; decode tok/s = the tokens after the first over
the time from the first event to the last. Medians, and network / shm.

Then the arithmetic for an 8k-token prompt from the measured bytes per token: what its K/V costs on a 10, 25 or
100 Gb/s link in full, and what the overlap leaves exposed (only the last chunk's transfer follows the last chunk's
compute). Check the load first (uptime): on a shared machine another job can halve a figure.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "splitgemma" / "shared" / "e2b-random.fgm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prompt-lens", default="512,2048")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker (default: 1; the host has 2 cores)")
    ap.add_argument("--logs", default=None, help="folder for the workers' logs (default: a temporary one)")
    args = ap.parse_args(argv)

    import grpc
    import numpy as np

    from splitgemma.v1 import serving_pb2 as pb
    from splitgemma.v1 import serving_pb2_grpc as pbg

    lens = [int(x) for x in args.prompt_lens.split(",")]
    shared_dir = tempfile.mkdtemp(prefix="sg-bench-kv-", dir="/dev/shm")
    hidden_dir = tempfile.mkdtemp(prefix="sg-bench-kv-hidden-", dir="/dev/shm")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="sg-bench-kv-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    geometry = ["--model", args.model, "--max-context", str(args.max_context), "--chunk", str(args.chunk),
                "--threads", str(args.threads)]
    ports = {name: free_port() for name in ("prefill", "shm", "network")}
    procs = {}

    def spawn(name, argv):
        with open(logs / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen([sys.executable, "-m", "splitgemma", *argv], stdout=log, stderr=log,
                                           stdin=subprocess.DEVNULL)

    spawn("prefill", ["prefill", *geometry, "--port", str(ports["prefill"]), "--shm-dir", shared_dir,
                      "--prefix-cache-bytes", "0"])
    for name, d in (("shm", shared_dir), ("network", hidden_dir)):
        spawn(name, ["decode", *geometry, "--port", str(ports[name]), "--shm-dir", d, "--slots", "2",
                     "--weights", "int4"])
    channels = {n: grpc.insecure_channel(f"127.0.0.1:{p}", options=[("grpc.max_receive_message_length", 64 << 20)])
                for n, p in ports.items()}
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        deadline = time.monotonic() + 600
        for name, ch in channels.items():
            while True:
                if procs[name].poll() is not None:
                    raise SystemExit(f"{name} exited: {(logs / f'{name}.log').read_text()[-2000:]}")
                try:
                    if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} not up after 600 s")
                time.sleep(0.2)
        prefill = pbg.PrefillStub(channels["prefill"])
        from splitgemma.engine import Model
        vocab = Model(args.model, threads=1, max_context=args.max_context, chunk=args.chunk, max_batch=1).vocab_size
        rng = np.random.default_rng(0)

        def one(arm: str, n: int, i: int) -> dict:
            decode = pbg.DecodeStub(channels[arm])
            rid = f"{arm}-{n}-{i}"
            prompt = [int(t) for t in rng.integers(4, vocab, n)]
            t0 = time.perf_counter()
            lease = decode.Reserve(pb.ReserveRequest(request_id=rid, prompt_tokens=n, max_tokens=args.max_tokens),
                                   timeout=600)
            lease.kv_address = f"127.0.0.1:{ports[arm]}"  # as the gateway fills it in
            pre = prefill.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, lease=lease,
                                                    sampling=pb.SamplingParams(temperature=0)), timeout=600)
            stamps, count = [], 0
            for ev in decode.Generate(pb.GenerateRequest(
                    request_id=rid, lease=lease, prompt_tokens=n, first_token=pre.first_token,
                    sampling=pb.SamplingParams(temperature=0), max_tokens=args.max_tokens, rng_state=pre.rng_state,
                    ignore_eos=True), timeout=600):
                stamps.append(time.perf_counter())
                count += len(ev.tokens)
            assert pre.kv_transport == arm, (arm, pre.kv_transport)
            return {"ttft": stamps[0] - t0, "tok_s": (count - 1) / (stamps[-1] - stamps[0]),
                    "prefill_s": pre.prefill_seconds, "wire": pre.kv_wire_bytes, "n": n}

        print(f"{Path(args.model).name}, {args.threads} thread(s) a worker, chunk {args.chunk}, {args.max_tokens} "
              f"tokens generated, {args.repeats} alternating runs per arm; load {os.getloadavg()[0]:.2f}")
        one("shm", lens[0], -1)
        one("network", lens[0], -1)  # warm both paths (page cache, channels)
        wire_per_token = []
        print(f"{'prompt':>7} {'arm':>8} {'TTFT s':>8} {'prefill s':>9} {'handoff s':>9} {'decode tok/s':>12} "
              f"{'wire B/token':>12}")
        for n in lens:
            rows = {"shm": [], "network": []}
            for i in range(args.repeats):
                for arm in ("shm", "network"):
                    rows[arm].append(one(arm, n, i))
            for rs in rows.values():
                for r in rs:
                    r["handoff"] = r["ttft"] - r["prefill_s"]
            keys = ("ttft", "prefill_s", "handoff", "tok_s", "wire")
            med = {arm: {k: statistics.median(r[k] for r in rs) for k in keys} for arm, rs in rows.items()}
            for arm in ("shm", "network"):
                m = med[arm]
                print(f"{n:>7} {arm:>8} {m['ttft']:>8.3f} {m['prefill_s']:>9.3f} {m['handoff']:>9.4f} "
                      f"{m['tok_s']:>12.2f} {m['wire'] / n:>12.0f}")
            wire_per_token.append(med["network"]["wire"] / n)
            ratio = {k: med["network"][k] / med["shm"][k] for k in ("ttft", "prefill_s", "handoff", "tok_s")}
            print(f"{n:>7} {'net/shm':>8} {ratio['ttft']:>8.3f} {ratio['prefill_s']:>9.3f} {ratio['handoff']:>9.2f} "
                  f"{ratio['tok_s']:>12.3f}")
        per_token = statistics.median(wire_per_token)
        total = 8192 * per_token
        last_chunk = args.chunk * per_token
        print(f"\n8k-token prompt: {per_token:,.0f} bytes a token on the wire = {total / 1e6:,.1f} MB of K/V")
        for gbps in (10, 25, 100):
            rate = gbps * 1e9 / 8
            print(f"  {gbps:>3} Gb/s: {total / rate * 1e3:7.1f} ms in full; exposed after the last chunk "
                  f"({args.chunk} positions): {last_chunk / rate * 1e3:6.2f} ms")
    finally:
        for ch in channels.values():
            ch.close()
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(shared_dir, ignore_errors=True)
        shutil.rmtree(hidden_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
