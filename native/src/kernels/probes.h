// Machine-limit probes for the benchmarks: what the backends could reach on this machine, to
// print measured kernel throughput beside it (bench/bench_gemm.py).
#pragma once

#include <cstddef>
#include <vector>

#include "gemm.h"

namespace sg {

// int8 TOPS of the backend's multiply-accumulate instruction run back to back on every pool
// thread at once (AVX2: vpmaddubsw+vpmaddwd+vpaddd, VNNI: vpdpbusd, AMX: tdpbssd), over about
// `seconds`. Throws std::runtime_error when the CPU cannot run the backend.
double peak_tops(Backend b, ThreadPool* pool, double seconds = 0.2);

// int8 TOPS of the AMX q8c kernel's 2×2 tile loop alone (gemm_amx.cpp: a 256-row chunk against one task's 64
// columns at K = 1536, no epilogue) on every pool thread at once, its operands from L2 except those `in_l1` names:
// 0 none, 1 the activations, 2 the weights, 3 both. Throws std::runtime_error without AMX, std::invalid_argument for
// another in_l1.
double amx_tile_loop_tops(int in_l1, ThreadPool* pool, double seconds = 0.2);

// f32 GFLOP/s (2 per fused multiply-add) of the backend's FMAs (ymm on avx2, zmm on vnni/amx) back to back on every
// pool thread at once, over about `seconds`: the limit of the weight-only q8g GEMM (gemm_q8g), which runs one such
// FMA per weight and row.
double peak_f32_gflops(Backend b, ThreadPool* pool, double seconds = 0.2);

// Streaming read bandwidth in GB/s (1e9 bytes/s), one reading per pass: every pool thread reads its slice of a
// `bytes`-long buffer (allocated and touched here; it should be at least what the measured work streams, e.g. the
// weight bytes of one decode step, so no cache level holds a useful part of it) `passes` times, each pass timed
// from the dispatch until the slowest thread is done. Throws std::invalid_argument when passes < 1 or the buffer
// is smaller than a page per thread.
std::vector<double> read_bandwidth_gbs(size_t bytes, ThreadPool* pool, int passes);
// The same over a caller's `bytes` at data (e.g. a mapped weight file's pages, wherever the page cache put them),
// read as they are: nothing allocated, nothing touched first.
std::vector<double> read_bandwidth_gbs(const void* data, size_t bytes, ThreadPool* pool, int passes);

}  // namespace sg
