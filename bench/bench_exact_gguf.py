"""Two conversions of the same model, alternated finely in one process: what exact GGUF weights (q8ga, issue 14)
cost against the former rounding of the Q4_K tensors into q8g.

    python bench/bench_exact_gguf.py OLD.fgm NEW.fgm [--rounds 12] [--prompt 512] [--steps 16] [--kernel-rounds 20]

Each round times, for both files in turn (the order flips every round), one prefill of --prompt random ids and
--steps decode steps at batch 1 and at batch 8 from that context (the context's K/V copied into 8 slots). A round
takes seconds, so a shared host's load drifts little between the two arms of one round: the per-round ratios
new/old and their median are the figure to quote, beside each arm's median tok/s and the load average.
`splitgemma bench` runs one arm for a minute at a time, which on a loaded 2-core host swings more than the effect.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from splitgemma import _native as N


def one_round(m, arena8, prompt: np.ndarray, steps: int) -> dict[str, float]:
    out = {}
    t0 = time.perf_counter()
    logits = m.prefill(arena8, 0, prompt)
    out["prefill"] = len(prompt) / (time.perf_counter() - t0)
    for s in range(1, 8):
        arena8.copy_slot(s, arena8, 0)
    tok = int(np.argmax(logits))
    for batch in (1, 8):
        slots, pos = list(range(batch)), len(prompt)
        if batch == 8:  # from the prompt's end again (slot 0 was extended by the batch-1 steps)
            arena8.copy_slot(0, arena8, 1)
        t0 = time.perf_counter()
        for i in range(steps):
            m.decode(arena8, slots, [tok] * batch, [pos + i] * batch)
        out[f"decode{batch}"] = steps * batch / (time.perf_counter() - t0)
    return out


def kernel_rounds(rounds: int, threads: int) -> None:
    """The GEMM alone on the 270M's Q4_K shapes (o_proj 640×1024, down_proj 640×2048, group 32): the same codes and
    scales without and with offsets, alternated; the minimum over the rounds (the least disturbed run) per arm."""
    rng = np.random.default_rng(1)
    for n, k in ((640, 1024), (640, 2048)):
        blob = rng.integers(0, 16, n * k).astype(np.uint8)
        scale = rng.uniform(1e-3, 1e-2, (k // 32, n)).astype(np.float32)
        offset = -rng.uniform(0, 1e-2, (k // 32, n)).astype(np.float32)
        for m in (1, 8, 256):
            x = rng.standard_normal((m, k)).astype(np.float32)
            best = {"q8g": np.inf, "q8ga": np.inf}
            for r in range(rounds):
                for arm in (("q8g", "q8ga") if r % 2 == 0 else ("q8ga", "q8g")):
                    off = offset if arm == "q8ga" else None
                    t0 = time.perf_counter()
                    for _ in range(20 if m < 256 else 4):
                        N.kernels.linear_packed(x, blob, scale, "q8g", n, k, group=32, threads=threads, offsets=off)
                    best[arm] = min(best[arm], time.perf_counter() - t0)
            print(f"GEMM M={m:3d} N={n} K={k}: q8g {best['q8g'] * 1e3:7.2f} ms, q8ga {best['q8ga'] * 1e3:7.2f} ms "
                  f"(per {20 if m < 256 else 4} calls, each with its own thread pool), q8ga/q8g "
                  f"{best['q8ga'] / best['q8g']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kernel-rounds", type=int, default=0, help="also time the GEMM alone, this many rounds")
    args = ap.parse_args()
    if args.kernel_rounds:
        kernel_rounds(args.kernel_rounds, args.threads)
    if args.rounds < 1:
        return
    arms = {}
    for name, path in (("old", args.old), ("new", args.new)):
        m = N.Model(path, max_context=args.prompt + 2 * args.steps + 8, threads=args.threads, max_batch=8)
        arms[name] = (m, N.KvArena(m, bytearray(8 * m.kv_slot_bytes), 8))
    prompt = np.random.default_rng(0).integers(3, 1000, args.prompt).astype(np.int32)
    for m, a in arms.values():  # warm the page cache and the code paths
        one_round(m, a, prompt[:64], 2)
    rows: dict[str, list[dict]] = {"old": [], "new": []}
    loads = []
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            rows[name].append(one_round(*arms[name], prompt, args.steps))
        loads.append(os.getloadavg()[0])
    print(f"{args.rounds} rounds, {args.threads} threads, backend {arms['new'][0].backend}, load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    for what in ("prefill", "decode1", "decode8"):
        old = [x[what] for x in rows["old"]]
        new = [x[what] for x in rows["new"]]
        ratios = [b / a for a, b in zip(old, new)]
        q = statistics.quantiles(ratios, n=4)
        print(f"{what:8s} old {statistics.median(old):7.1f} tok/s  new {statistics.median(new):7.1f} tok/s  "
              f"new/old per round: median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


if __name__ == "__main__":
    main()
