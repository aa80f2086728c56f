"""Where the AMX q8c GEMM loses its peak on this machine (issue 14; docs/benchmarks.md, session 24).

Beside the tdpbssd peak measured in the same run, on one thread and on --threads:
  * loop      the q8c kernel's 2x2 tile loop alone (kernels.amx_tile_loop_tops: a 256-row chunk against one task's
              64 columns at K=1536, in the kernel's operand layouts, no epilogue), its operands from L2, or the
              activations, the weights or both held in L1: how fast the loop can be, by where its operands come from;
  * gemm      the q8c GEMM itself (kernels.bench_linear, M=256, K=1536, the FFN gate's shape, activations quantised
              outside the timing) with its weights hot (N=128: two tasks' weights, L2-resident) and streamed (N=6144
              cycled through 8 copies, 75 MB, as a prefill's layers stream theirs): what the K slices' accumulator
              round trips, the epilogue and the weights' first arrival cost on top of the loop.
Every figure is the median of --repeats readings. The machine is shared: the load average is printed, and a loaded
machine lowers every figure. Needs AMX (`lscpu | grep amx_int8`).

    python bench/bench_amx_tiles.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

from splitgemma._native import kernels as K
from splitgemma.commands.bench import cpu_model

M, K_DIM = 256, 1536
STREAM_N, STREAM_COPIES = 6144, 8
HOT_N = 128
IN_L1 = ("none", "activations", "weights", "both")


def gemm_tops(rng, n: int, copies: int, threads: int, repeats: int) -> float:
    codes = rng.integers(-127, 128, n * K_DIM * copies, dtype=np.int8).view(np.uint8)
    scales = rng.uniform(1e-3, 1e-2, n * copies).astype(np.float32)
    x = rng.standard_normal((M, K_DIM)).astype(np.float32)
    calls = max(2 * copies, int(2e9 / (2 * M * n * K_DIM)))  # ~2 G operations a reading
    K.bench_linear(x, codes, scales, "q8c", n, K_DIM, backend="amx", threads=threads, repeats=calls, copies=copies)
    seconds = statistics.median(
        statistics.median(K.bench_linear(x, codes, scales, "q8c", n, K_DIM, backend="amx", threads=threads,
                                         repeats=calls, copies=copies))
        for _ in range(repeats))
    return 2 * M * n * K_DIM / seconds / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not K.cpu_supports("amx"):
        raise SystemExit("bench_amx_tiles: this CPU has no AMX (amx_int8)")
    rng = np.random.default_rng(0)
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{'threads':>7}  {'measured':62} {'TOPS':>7} {'of peak':>8}")
    for threads in sorted({1, args.threads}):
        peak = statistics.median(K.peak_tops("amx", threads) for _ in range(args.repeats))
        print(f"{threads:>7}  {'tdpbssd back to back (the peak)':62} {peak:7.2f} {1:8.0%}")
        for in_l1 in IN_L1:
            tops = statistics.median(K.amx_tile_loop_tops(in_l1, threads) for _ in range(args.repeats))
            what = f"loop, in L1: {in_l1}" + (" (the rest from L2)" if in_l1 != "both" else "")
            print(f"{threads:>7}  {what:62} {tops:7.2f} {tops / peak:8.0%}")
        for label, n, copies in ((f"gemm M={M} N={HOT_N} K={K_DIM}, weights hot", HOT_N, 1),
                                 (f"gemm M={M} N={STREAM_N} K={K_DIM}, weights streamed ({STREAM_COPIES} copies)",
                                  STREAM_N, STREAM_COPIES)):
            tops = gemm_tops(rng, n, copies, threads, args.repeats)
            print(f"{threads:>7}  {label:62} {tops:7.2f} {tops / peak:8.0%}")


if __name__ == "__main__":
    main()
