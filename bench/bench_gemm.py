"""GEMM kernel throughput beside this machine's own limits, measured in the same run.

For every backend the CPU can run (or --backend):
  * peak      int8 TOPS of the backend's multiply-accumulate instruction back to back
              (AVX2 vpmaddubsw+vpmaddwd+vpaddd, VNNI vpdpbusd, AMX tdpbssd) on --threads threads;
  * DRAM      streaming read bandwidth (GB/s) on --threads threads;
  * prefill   q8c GEMM M=512, N=6144, K=1536 (an E2B FFN projection): TOPS and ratio to peak;
  * decode    q4g (group 256) GEMM N=6144, K=1536 at M = 1, 8, 32: GB/s of weight bytes
              (codes + scales) streamed from DRAM (the weights cycle through copies twice the largest
              cache the host reports, at least 96 MB) and ratio to the DRAM figure; TOPS and ratio to peak too.
And for q8g (weight-only int8, f32 activations: ymm on avx2, zmm on vnni/amx), on Gemma 3 270M's
shapes, against the backend's f32 FMA peak and DRAM:
  * prefill   M=256, N=2048, K=640, group 32 (an FFN gate/up projection): GFLOP/s and ratio to peak;
  * decode    the tied LM head N=262144, K=640 (168 MB of codes, in copies as above) at M = 1, 8.
Every figure is the median of --repeats runs. The machine is shared: the load average is
printed, and a loaded machine lowers every figure.

    python bench/bench_gemm.py [--threads 2] [--repeats 7] [--backend avx2]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import numpy as np

from splitgemma._native import kernels as K
from splitgemma.commands.bench import cpu_model

N, K_DIM, GROUP = 6144, 1536, 256
PREFILL_M = 512
DECODE_M = (1, 8, 32)
DRAM_PROBE_BYTES = 1 << 30  # the bandwidth probe's buffer: of the order of an E2B decode step (1.3 GB)


def stream_set_bytes() -> int:
    """Bytes of weight copies a decode figure cycles through: twice the largest cache the host reports, at least 96
    MB. (A fixed 96 MB was well above the AMD hosts' 32 MB L3, but the Xeon with AMX reports 480 MB: there the q4g
    GEMV "streamed" 35 GB/s = 101% of the DRAM probe from a 96 MB set, and 23-26 GB/s from 600 MB; session 41.)"""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        largest = max(largest, int(text.rstrip("KMG")) * scale)
    return max(96 << 20, 2 * largest)


def random_weights(rng, dtype: str, copies: int):
    if dtype == "q8c":
        codes = rng.integers(-127, 128, N * K_DIM * copies, dtype=np.int8).view(np.uint8)
        scales = rng.uniform(1e-3, 1e-2, N * copies).astype(np.float32)
    else:
        codes = rng.integers(0, 256, N * K_DIM // 2 * copies, dtype=np.uint8)
        scales = (rng.uniform(1e-3, 1e-2, (K_DIM // GROUP * copies, N)) * rng.choice([-1, 1], N)).astype(np.float16)
    return codes, scales


def median_time(x, codes, scales, dtype, backend, threads, repeats, copies, calls_per_repeat):
    """Median over repeats of the mean seconds per call in a batch of calls (warm-up excluded)."""
    group = GROUP if dtype == "q4g" else 0
    K.bench_linear(x, codes, scales, dtype, N, K_DIM, group=group, hadamard=128, backend=backend, threads=threads,
                   repeats=min(copies, 4), copies=copies)
    per_repeat = []
    for _ in range(repeats):
        t = K.bench_linear(x, codes, scales, dtype, N, K_DIM, group=group, hadamard=128, backend=backend,
                           threads=threads, repeats=calls_per_repeat, copies=copies)
        per_repeat.append(sum(t) / len(t))
    return statistics.median(per_repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--backend", choices=["avx2", "vnni", "amx"], action="append",
                    help="backend(s) to measure (default: every one this CPU runs)")
    args = ap.parse_args()
    backends = args.backend or [b for b in ("amx", "vnni", "avx2") if K.cpu_supports(b)]
    rng = np.random.default_rng(0)

    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; threads {args.threads}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    passes = K.read_bandwidth(DRAM_PROBE_BYTES, args.threads, args.repeats)
    dram = statistics.median(passes)
    print(f"DRAM streaming read: {dram:.1f} GB/s (median of {args.repeats} passes over {DRAM_PROBE_BYTES >> 20} MB, "
          f"range {min(passes):.1f}–{max(passes):.1f})")

    q8_codes, q8_scales = random_weights(rng, "q8c", 1)
    q4_bytes = N * K_DIM // 2 + (K_DIM // GROUP) * N * 2
    stream_set = stream_set_bytes()
    q4_copies = max(1, stream_set // q4_bytes)
    q4_codes, q4_scales = random_weights(rng, "q4g", q4_copies)

    header = f"{'backend':8} {'shape':34} {'time':>10} {'result':>14} {'limit':>14} {'ratio':>7}"
    for b in backends:
        peak = statistics.median(K.peak_tops(b, args.threads) for _ in range(args.repeats))
        print()
        print(f"[{b}] peak int8: {peak:.3f} TOPS on {args.threads} threads")
        print(header)
        x = rng.standard_normal((PREFILL_M, K_DIM)).astype(np.float32)
        t = median_time(x, q8_codes, q8_scales, "q8c", b, args.threads, args.repeats, 1, 3)
        tops = 2 * PREFILL_M * N * K_DIM / t / 1e12
        print(f"{b:8} {f'prefill q8c M={PREFILL_M} N={N} K={K_DIM}':34} {t * 1e3:8.2f}ms "
              f"{tops:9.3f} TOPS {peak:9.3f} TOPS {tops / peak:7.1%}")
        for m in DECODE_M:
            x = rng.standard_normal((m, K_DIM)).astype(np.float32)
            t = median_time(x, q4_codes, q4_scales, "q4g", b, args.threads, args.repeats, q4_copies, 2 * q4_copies)
            gbs = q4_bytes / t / 1e9
            tops = 2 * m * N * K_DIM / t / 1e12
            print(f"{b:8} {f'decode q4g g{GROUP} M={m} N={N} K={K_DIM}':34} {t * 1e3:8.3f}ms "
                  f"{gbs:9.2f} GB/s {dram:9.2f} GB/s {gbs / dram:7.1%}   ({tops:.3f} TOPS, {tops / peak:.1%} of peak)")
    for b in backends:
        q8g_section(rng, b, args.threads, args.repeats, dram, stream_set)


def q8g_section(rng, backend: str, threads: int, repeats: int, dram: float, stream_set: int) -> None:
    peak = statistics.median(K.peak_f32_gflops(threads, backend=backend) for _ in range(repeats))
    print()
    width = "ymm" if backend == "avx2" else "zmm"
    print(f"[{backend} q8g] peak f32 FMA ({width}): {peak:.1f} GFLOP/s on {threads} threads")
    print(f"{'backend':8} {'shape':34} {'time':>10} {'result':>14} {'limit':>14} {'ratio':>7}")
    for m, n, k, group in ((256, 2048, 640, 32), (1, 262144, 640, 32), (8, 262144, 640, 32)):
        # The LM head's copies, cycled, outgrow the caches as the q4g decode set does; the prefill shape stays hot.
        copies = 1 if m > 8 else max(1, -(-stream_set // (n * k)))
        codes = rng.integers(-127, 128, n * k * copies, dtype=np.int8).view(np.uint8)
        scales = rng.uniform(-1e-2, 1e-2, (k // group * copies, n)).astype(np.float32)
        x = rng.standard_normal((m, k)).astype(np.float32)
        K.bench_linear(x, codes, scales, "q8g", n, k, group=group, backend=backend, threads=threads, repeats=2,
                       copies=copies)
        t = statistics.median(statistics.median(K.bench_linear(x, codes, scales, "q8g", n, k, group=group,
                                                               backend=backend, threads=threads,
                                                               repeats=3 * copies, copies=copies))
                              for _ in range(repeats))
        gflops = 2 * m * n * k / t / 1e9
        shape = f"{'prefill' if m > 8 else 'decode'} q8g g{group} M={m} N={n} K={k}"
        if m > 8:
            print(f"{backend:8} {shape:34} {t * 1e3:8.2f}ms {gflops:7.1f} GFLOP/s {peak:7.1f} GFLOP/s {gflops / peak:7.1%}")
        else:
            gbs = (n * k + scales.nbytes / copies) / t / 1e9
            print(f"{backend:8} {shape:34} {t * 1e3:8.2f}ms {gbs:9.2f} GB/s {dram:9.2f} GB/s {gbs / dram:7.1%}   "
                  f"({gflops:.1f} GFLOP/s, {gflops / peak:.1%} of peak)")


if __name__ == "__main__":
    main()
