// Internal interface between the dispatcher (backend.cpp) and the per-ISA translation units.
// Each kernel function lives in a TU compiled with that ISA's flags and must only be called
// after cpu_supports() said yes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "gemm.h"
#if defined(__AVX512F__) || defined(SG_KERNEL_EMULATION)  // the emulated build's immintrin.h has scalar zmm
#include <immintrin.h>
#endif

namespace sg::detail {

// Output columns of the 16-column blocks [nb0, nb1), all a.m rows. Arguments already validated.
void gemm_avx2(const QAct& a, const QLinear& w, float* y, int ldy, int nb0, int nb1);
void gemm_vnni(const QAct& a, const QLinear& w, float* y, int ldy, int nb0, int nb1);
void gemm_amx(const QAct& a, const QLinear& w, float* y, int ldy, int nb0, int nb1);
// q8g (weight-only int8, f32 activations): output columns of the 16-column panels [p0, p1), all m rows; AVX2 + FMA
// (the AVX2 backend) and AVX-512 (the VNNI and AMX backends), bit-identical. xsum: for a weight with offsets (q8ga),
// each row's group sums of x, [m][K/G] (gemm_q8g); null otherwise.
void gemm_q8g_panels(const float* x, int ldx, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0,
                     int p1);
// xs[i][g] = the sum of x[i, k] over group g, in the order of gemm.h (gemm_q8g.cpp, AVX2: every backend's floor).
void q8g_group_sums(const float* x, int ldx, int m, int k, int group, float* xs);
void gemm_q8g_panels_avx512(const float* x, int ldx, int m, const QLinear& w, const float* xsum, float* y, int ldy,
                            int p0, int p1);

// The q8g kernels' register blocks: rows go in balanced blocks of at most max_rows (8 rows on 6: 4 + 4, not 6 + 2,
// whose 2-row block would be bound by its few chains). The int8 kernels' largest blocks, which the int8 activations
// are laid out in: ymm (gemm_q8g.cpp) 4 rows (8 int32 sums with the step's 4 weight vectors, a broadcast and the ones
// fill the 16 registers; 6 rows spilled sums to the stack every step); zmm (gemm_q8g_avx512.cpp) 8 for a decode batch
// (at most 32 rows), 6 for more. (zmm, 32 rows, LM head from DRAM, alternated in one process on Zen 5: 4 blocks of 8
// rows × 3 panels took 0.64-0.92x the time of 11 + 11 + 10 rows × 2 panels; 24 rows 0.88x, 12 rows 0.86x. On Zen 4
// 8 rows × 2 panels beat both: gemm_q8g_avx512.cpp, kPanelsForInt8.)
constexpr int kQ8gYmmRows = 4, kQ8gZmmDecodeRows = 8, kQ8gZmmPrefillRows = 6, kQ8gZmmDecodeMaxM = 32;
inline int q8g_max_rows(bool zmm, int m) {
  return !zmm ? kQ8gYmmRows : m > kQ8gZmmDecodeMaxM ? kQ8gZmmPrefillRows : kQ8gZmmDecodeRows;
}
inline int q8g_rows_per_block(int m, int max_rows) {
  const int blocks = (m + max_rows - 1) / max_rows;
  return (m + blocks - 1) / blocks;
}

// q8g with int8 activations (gemm.h, Q8gInput::Int8): the rows quantised once per gemm_q8g_multi call for all its
// targets, laid out in the kernel's register blocks of R = block_rows rows: block b (rows bR .. bR + r - 1, r =
// min(R, m - bR)) starts at bR·k, and holds its r rows' codes of each 4-input step side by side (step k/4 of its row
// i at (k/4)·4r + 4i). A kernel thus broadcasts row i's codes of a step from one pointer plus 4i (an immediate),
// walking its block's bytes in order; with a pointer per row, eleven pointers were spilled and reloaded every step
// (measured ~2x the instructions of the multiply-adds), and with all m rows side by side a 256-row prefill chunk
// touched a new cache line every step.
struct Q8gActs {
  int m = 0, k = 0;
  int block_rows = 0;        // R: q8g_rows_per_block(m, the kernel's max_rows)
  int8_t* codes = nullptr;   // [m·k] as above; each in [-127, 127]
  float* scale = nullptr;    // [k/32][m]: a[i][b] of gemm.h at b·m + i
  // -128 · the sum of the codes of each 16 (32) inputs: the VNNI kernel multiplies code + 128 (vpdpbusd's unsigned
  // operand is the weight's) and starts each unit's int32 sum here, so that it ends exact; the AVX2 kernel on a narrow
  // weight (weight code + 16 or + 32 unsigned) drops bias / 8 or bias / 4 from its unit sums for the same reason.
  int32_t* bias16 = nullptr;  // [k/16][m]
  int32_t* bias32 = nullptr;  // [k/32][m]
};
// Rows [r0, r1) of x (m rows, k % 32 == 0) into a's buffers (gemm.h's quantiser, plain AVX2, so every
// backend gets the same codes).
void q8g_quantize_rows(const float* x, int ldx, int r0, int r1, const Q8gActs& a);
// The int8-activation kernels: AVX2 (vpmaddubsw on the sign trick, or on the offset codes of a narrow weight) and
// AVX-512 VNNI (vpdpbusd), bit-identical.
void gemm_q8g_int8_panels(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0,
                          int p1);
void gemm_q8g_int8_panels_avx512(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy,
                                 int p0, int p1);
// The same on AMX tiles (gemm_q8g_amx.cpp), bit-identical to both: for the AMX backend where the tile state holds
// (amx_tiles_usable: no guard) and the call has at least kQ8gAmxMinRows rows. It reads the activations of up to 16
// rows at a time as one tile, so `a` must be laid out with block_rows = 1 (row i's codes at i·k: rows one after
// another) and its codes buffer must hold q8g_amx_padded_rows(m) rows (the rows past m are read, never used).
void gemm_q8g_int8_panels_amx(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0,
                              int p1);
// From 9 rows: below, the VNNI kernel was as fast (at 1-4 rows both stream the weights at the memory's rate). 2
// threads, Gemma 3 270M's shapes (N×K 2048×640, 640×2048, 1024×640, the LM head 262144×640), amx time over vnni on
// a Xeon (docs/benchmarks.md, session 25; one row block walks its panels as one stream, the tiles configured for
// its rows): 8 rows 0.92-1.04, 9 rows 0.74-0.89, 10-12 rows 0.80-0.90, 16 rows 0.73-0.81, 24 rows 0.85-0.95,
// 32 rows 0.71-0.84. (Session 19, each panel walked on its own: 8 rows 1.18-1.50, 16 rows 0.90-1.08.)
constexpr int kQ8gAmxMinRows = 9;
inline int q8g_amx_padded_rows(int m) { return (m + 15) / 16 * 16; }

// Peak-throughput loops: run the backend's int8 multiply-accumulate instruction back to back
// (independent accumulators, register operands) for `iters` iterations; return the number of
// int8 operations done (2 per multiply-add), for peak_tops().
uint64_t peak_loop_avx2(uint64_t iters);
uint64_t peak_loop_vnni(uint64_t iters);
uint64_t peak_loop_amx(uint64_t iters);
// The AMX q8c kernel's 2×2 tile loop on L2-resident operands (gemm_amx.cpp), indexed by which stay in L1: 0 neither,
// 1 the activations, 2 the weights, 3 both; for amx_tile_loop_tops().
extern uint64_t (*const tile_loop_amx_fns[4])(uint64_t);
// f32 FMAs back to back, 2 flops each: ymm (probes.cpp) and zmm (gemm_q8g_avx512.cpp), the q8g kernels' limits.
uint64_t peak_loop_fma(uint64_t iters);
uint64_t peak_loop_fma512(uint64_t iters);

// CPUID's vendor is AMD (backend.cpp): where a kernel's best memory access pattern was measured to differ by vendor.
bool cpu_is_amd();
// AMX: ARCH_REQ_XCOMP_PERM for the calling thread (backend.cpp); true when granted.
bool amx_request_permission();
// The same, asked once per thread (a GEMM may run on a thread the pool did not start: the caller's).
inline void amx_thread_permission() {
  thread_local bool granted = false;
  if (!granted) granted = amx_request_permission();
}
// AMX: before a GEMM, on the calling thread: tile permission, and the tile guard decided once
// (FGM_TILE_GUARD or the probe; throws std::runtime_error on a bad FGM_TILE_GUARD value).
void amx_prepare();
// amx_prepare(), then whether the guard is off (gemm_amx.cpp).
bool amx_guard_off();
// The guard state and recovery count, kept in backend.cpp (plain x86-64 code).
extern std::atomic<int> g_amx_guard;  // -1 undecided, 0 off, 1 on
extern std::atomic<uint64_t> g_amx_recoveries;

// Runs f(task, worker) for task in [0, n) on the pool, or inline when pool is null.
template <class F>
void run_tasks(ThreadPool* pool, int n, F& f) {
  if (!pool) {
    for (int t = 0; t < n; ++t) f(t, 0);
    return;
  }
  pool->parallel_for(n, f);
}

// quantize_activations() and quantize_activations_from() with the given row quantiser (activations.cpp: ymm,
// activations_avx512.cpp: zmm): validates the arguments, fills in out->m/k/hadamard, runs quantize_one(row, k,
// hadamard, row index, out) for every row and sets the padding rows' scale and rowsum to 0 (gemm.h), over the pool
// when the input is large enough. The rows are x's (src null) or src's, made one at a time into a buffer of the
// task's.
using QuantizeRowFn = void (*)(const float* x, int k, int hadamard, int row, QAct* out);
void quantize_rows(const float* x, int ldx, const RowSource* src, int m, int k, int hadamard, QAct* out,
                   ThreadPool* pool, QuantizeRowFn quantize_one);

// Block-sizing shared by the backends: a prefill task is kTaskBlocks 16-column blocks. A decode task (at most
// kDecodeTaskMaxRows rows) is as many blocks as leave two tasks a thread, between kTaskBlocks and
// kDecodeTaskMaxBlocks: a decode GEMM streams its weights once, every task start begins its strips cold, and a task's
// last prefetches run into columns another thread takes, so 4-block tasks (48 KB of int4 at K=1536) kept each
// thread's stream short. Measured (bench/ab_gemm_vnni, Zen 5, tasks of 4 against 32-64 blocks, alternated call by
// call, docs/benchmarks.md session 11): q4g 8 rows 0.71-0.79x the time, 4 rows 0.86x, 1 row 0.80-0.96x, 32 rows
// 0.94-0.97x; prefill (256 rows) was no faster with 16 and slower with 48, so it keeps kTaskBlocks.
constexpr int kTaskBlocks = 4;
constexpr int kDecodeTaskMaxRows = 64;
constexpr int kDecodeTaskMaxBlocks = 64;
inline int task_blocks(int m, int nb, int threads) {
  if (m > kDecodeTaskMaxRows) return kTaskBlocks;
  const int even = nb / (2 * (threads > 1 ? threads : 1));
  return even < kTaskBlocks ? kTaskBlocks : even > kDecodeTaskMaxBlocks ? kDecodeTaskMaxBlocks : even;
}

// Prefill-sized GEMM outputs (more than kStreamMinRows rows and at least kStreamOutputBytes: a 256-row chunk's gate
// and up are 6 MB each) are written with streaming stores by the zmm kernels (AMX, VNNI): they outgrow both cores'
// L2, so a normal store would first read each line from L3 or DRAM (read-for-ownership) only to overwrite all 64
// bytes of it. Decode batches keep normal stores: their one large output is the LM head's logits, which the sampler
// reads at once. Rows must start on cache lines (the engine's buffers do). Measured: docs/benchmarks.md, session 10.
constexpr size_t kStreamOutputBytes = size_t(4) << 20;
constexpr int kStreamMinRows = 64;
inline bool stream_output(const QAct& a, const QLinear& w, const float* y, int ldy) {
  return a.m > kStreamMinRows && size_t(a.m) * size_t(w.n) * sizeof(float) >= kStreamOutputBytes &&
         reinterpret_cast<uintptr_t>(y) % 64 == 0 && ldy % 16 == 0;
}
#if defined(__AVX512F__) || defined(SG_KERNEL_EMULATION)
// 16 output floats at a 64-byte-aligned dst when streaming; a kernel that streamed ends with _mm_sfence() (streaming
// stores are weakly ordered; the fence makes them visible before the pool's barrier reports the task done).
inline void store_out(float* dst, __m512 v, bool stream) {
  if (stream) _mm512_stream_ps(dst, v);
  else _mm512_storeu_ps(dst, v);
}
#endif

}  // namespace sg::detail
