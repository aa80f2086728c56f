"""Prefill scheduling benchmark: time to first token of concurrent prompts per --prefill-policy.

    python bench/bench_prefill_sched.py --model m.fgm [--lens 2048,256,1024,64,512,2048,128,768]
                                        [--policies rr,srf,fifo] [--chunk 256] [--threads 2] [--rounds 1]

For each policy a decode worker and a prefill worker with that policy start on a private shared-memory folder; all
prompts (random token ids of the given lengths, in that order) are sent at once over gRPC, each into its own leased
slot, and each call's TTFT is the time from sending it to its PrefillResponse (the first token). Reported: TTFT of
the first, median and last prompt to finish, the mean, the TTFT of the shortest prompt, and throughput = all prompt
tokens / the time the last one took. The first-token ids and checksums must agree across policies (a scheduled
prompt is bit-identical to a solo one); the script says so. The machine is shared: the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

from splitgemma.serving.ports import free_ports
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pb_grpc


def _start(kind: str, argv: list[str]) -> tuple[subprocess.Popen, grpc.Channel]:
    (port,) = free_ports(1)
    p = subprocess.Popen([sys.executable, "-m", "splitgemma", kind, "--port", str(port), "--log-level", "WARNING",
                          *argv])
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(ch).result(timeout=600)
    return p, ch


def one_round(args, policy: str, prompts: list[np.ndarray]) -> dict:
    shm = tempfile.mkdtemp(prefix="sg-bench-sched-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    geometry = ["--model", args.model, "--max-context", str(args.max_context), "--chunk", str(args.chunk),
                "--shm-dir", shm]
    if args.threads:
        geometry += ["--threads", str(args.threads)]
    procs = []
    try:
        d, dch = _start("decode", [*geometry, "--slots", str(len(prompts)), "--lease-ms", "3600000"])
        procs.append(d)
        p, pch = _start("prefill", [*geometry, "--prefill-policy", policy, "--max-prompts", str(len(prompts))])
        procs.append(p)
        decode, prefill = pb_grpc.DecodeStub(dch), pb_grpc.PrefillStub(pch)
        sampling = pb.SamplingParams(temperature=0, seed=1)
        reqs = []
        for i, tokens in enumerate(prompts):
            rid = f"{policy}-{i}"
            lease = decode.Reserve(pb.ReserveRequest(request_id=rid, prompt_tokens=len(tokens), max_tokens=1),
                                   timeout=60)
            reqs.append(pb.PrefillRequest(request_id=rid, prompt_token_ids=tokens.tolist(), lease=lease,
                                          sampling=sampling))
        done: dict[int, float] = {}
        t0 = time.perf_counter()
        futures = []
        for i, r in enumerate(reqs):
            f = prefill.Prefill.future(r, timeout=24 * 3600)
            f.add_done_callback(lambda _f, i=i: done.setdefault(i, time.perf_counter() - t0))
            futures.append(f)
        results = [f.result() for f in futures]
        makespan = max(done.values())
        for r in reqs:
            decode.Release(pb.ReleaseRequest(request_id=r.request_id, lease=r.lease), timeout=60)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        shutil.rmtree(shm, ignore_errors=True)
    ttft = sorted(done.values())
    shortest = min(range(len(prompts)), key=lambda i: len(prompts[i]))
    return {"policy": policy, "first": ttft[0], "median": statistics.median(ttft), "last": ttft[-1],
            "mean": statistics.fmean(ttft), "shortest": done[shortest],
            "tok_s": sum(map(len, prompts)) / makespan,
            "per_prompt": [done[i] for i in range(len(prompts))],
            "results": [(r.first_token.token_id, r.kv_checksum) for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lens", default="2048,256,1024,64,512,2048,128,768")
    ap.add_argument("--policies", default="rr,srf,fifo")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=None, help="default: the longest prompt + 16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="rounds per policy (policies alternate)")
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    args.max_context = args.max_context or max(lens) + 16
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 1024, n) for n in lens]
    print(f"model {args.model}, chunk {args.chunk}, prompts {lens} sent at once, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for _ in range(args.rounds):
        for policy in args.policies.split(","):
            r = one_round(args, policy, prompts)
            rows.append(r)
            print(f"  {policy}: per prompt (s) {' '.join(f'{t:.2f}' for t in r['per_prompt'])}; load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    same = len({tuple(r["results"]) for r in rows}) == 1
    print("\n| policy | TTFT first | median | last | mean | shortest prompt | prompt tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['first']:.2f} s | {r['median']:.2f} s | {r['last']:.2f} s | {r['mean']:.2f} s "
              f"| {r['shortest']:.2f} s | {r['tok_s']:.0f} |")
    print(f"\nfirst tokens and K/V checksums identical across policies: {same}")


if __name__ == "__main__":
    main()
