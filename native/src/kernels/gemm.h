// Quantised GEMM on the .fgm's tile-ordered weights, on three backends that read the same
// bytes: AMX (Intel AMX-INT8 tiles), VNNI (AVX-512 VNNI) and AVX2 (any x86-64 with AVX2,
// FMA and F16C, e.g. AMD EPYC; the portable floor).
//
// Contract: y[m, n] = sum_k x[m, k] * W[n, k] (f32 out), where x is given as f32 rows and is
// Hadamard-rotated (when the weight is) and quantised to int8 per row once by
// quantize_activations(); every GEMM sharing that input reuses the QAct.
//
// Arithmetic (identical on every backend, so their outputs are BIT-IDENTICAL):
//   Activations (backend-independent code): x' = fwht128(x) when hadamard = 128, else x;
//     amax = max_k |x'[m,k]|; a_scale[m] = amax / 127.0f (f32 division), or 1 when amax = 0;
//     code = clamp(round_half_even(x' / a_scale), -127, 127) (f32 division).
//   q8c:  acc[m,n] = the exact int32 sum over all K of code·q;
//         y[m,n] = ((float)acc * a_scale[m]) * w_scale[n]             (two f32 multiplies).
//   q4g:  acc_g[m,n] = the exact int32 sum over k-group g of code·q;
//         s = 0; for g = 0, 1, …, K/G−1 in order: s = fmaf((float)acc_g, (float)scale[g][n], s);
//         y[m,n] = s * a_scale[m].
//   int32 → f32 is round-to-nearest-even; fmaf is one fused multiply-add (one rounding).
// How each backend reaches the exact int32 sums (sign tricks, +bias with a −bias·Σcode
// correction from QAct.rowsum, AMX tiles) is its own business: any exact method gives the
// same integers, and the float steps above are then performed in exactly this order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fgm_file.h"
#include "threadpool.h"

namespace sg {

enum class Backend : int { Avx2 = 0, Vnni = 1, Amx = 2 };

// Decided once per process from FGM_BACKEND (amx|vnni|avx2) or CPUID (+ the AMX tile
// permission grant); printed once to stderr. Throws std::runtime_error when FGM_BACKEND asks
// for an instruction set this CPU lacks (or names no backend), or when the CPU lacks even AVX2.
Backend active_backend();
const char* backend_name(Backend b);
// "amx" | "vnni" | "avx2" → Backend; throws std::invalid_argument on anything else.
Backend backend_from_name(const char* name);
// Whether this CPU (and OS) can run the backend. For AMX this includes a successful
// ARCH_REQ_XCOMP_PERM grant on the calling thread.
bool cpu_supports(Backend b);
// Per-thread set-up the backend needs (AMX: ARCH_REQ_XCOMP_PERM). Safe to call repeatedly;
// pass it as the ThreadPool's thread_init. The AMX kernels also call it themselves on first
// use in a thread, so forgetting it costs nothing but a syscall.
void backend_thread_init();

// Whether code beside the GEMMs (the prefill attention) may use AMX tiles on the calling thread: the CPU runs the
// AMX backend, the thread holds the tile permission, and the tile-state guard (below) is off. A host that loses tile
// state keeps AMX to the guarded GEMMs.
bool amx_tiles_usable();
// The same, and the CPU has AMX-BF16 (tdpbf16ps: the f16 K/V attention's dot products, attend_rows_amx.h).
bool amx_bf16_tiles_usable();

// The AMX tile-state guard (see gemm_amx.cpp): enabled is -1 until the first AMX GEMM decided
// it (FGM_TILE_GUARD=on|off, else a probe), then 0/1; recoveries counts blocks recomputed
// because the tile state was lost.
struct TileGuardStatus {
  int enabled = -1;
  uint64_t recoveries = 0;
};
TileGuardStatus amx_tile_guard_status();

// A linear weight as stored in the file (q8c or q4g in tile order; q8g and q8ga in 16-column panels). A q8ga tensor
// is a q8g one with offsets: dtype Q8G and `offsets` set.
struct QLinear {
  DType dtype = DType::Q8C;
  int n = 0, k = 0;
  int group = 0;     // q4g / q8g scale group along K
  int hadamard = 0;  // 128: the input must be rotated
  const uint8_t* codes = nullptr;
  const void* scales = nullptr;  // f32[n] (q8c), f16[k/group][n] (q4g) or f32/f16[k/group][n] (q8g)
  // q8g: the scales are f16 (the exact f16 block scales of a GGUF's Q8_0, Q5_0, …: half the bytes, the same values),
  // else f32 (docs/fgm-extensions.md).
  bool scales_f16 = false;
  const float* offsets = nullptr;  // q8g from a q8ga tensor: f32[k/group][n], W = code · s + o; else null
  // q8g: a bound on every |code| (q8g_code_bound; 127 when not scanned), or kQ8gNibbleCodes (15): every code in
  // 0..15. The GGUF block formats a converted Gemma 3 keeps exactly hold narrow codes (Q4_K 0..15: 15; Q5_0 -16..15:
  // 16; Q6_K: 32), on which the AVX2 int8 kernel needs no sign trick and sums several steps' products in int16
  // (gemm_q8g.cpp, q8g_int8_block's NARROW).
  int max_code = 127;
};
// A q8g weight's scales (f32 or f16) from some element on: `+ i` steps i elements of either width, so the kernels
// walk [K/G][N] alike and only their loads (load_scales8 / load_scales16) convert f16.
struct Q8gScales {
  const void* p = nullptr;
  bool f16 = false;
  Q8gScales operator+(size_t i) const { return {static_cast<const char*>(p) + (f16 ? 2 : 4) * i, f16}; }
  const char* bytes() const { return static_cast<const char*>(p); }
};
inline Q8gScales q8g_scales(const QLinear& w) { return {w.scales, w.scales_f16}; }
// QLinear::max_code of q8g codes that all lie in 0..15 (Q4_K's and Q4_1's nibbles).
constexpr int kQ8gNibbleCodes = 15;
// QLinear::max_code of n q8g codes (int8): kQ8gNibbleCodes when each lies in 0..15, else 16 or 32 when that bounds
// every |code|, else 127 (codes of -128 included).
int q8g_code_bound(const uint8_t* codes, size_t n);
// Throws FgmError when t is not a q8c/q4g/q8g/q8ga linear or its companion .scale (q8ga: .offset) is missing.
QLinear qlinear_from(const FgmFile& f, const TensorInfo& t);

// Activations quantised per row to int8 (after the Hadamard transform when hadamard > 0),
// packed ONCE in the one layout every backend reads: the AMX A-tile order
//   packed[((m/16)·(k/64) + k/64-block)·1024 + (m%16)·64 + k%64],
// rows padded up to qact_padded_rows(m) (a multiple of 16). VNNI/AVX2 broadcast 4-byte groups
// from the same bytes. The padding rows' codes are whatever the buffer held (a kernel may
// compute them along, whole tiles or register blocks at a time, but never stores their outputs;
// their scale and rowsum are 0, so such an output is 0 anyway). Buffers are caller-owned and
// sized by the functions below; nothing is allocated per call.
struct QAct {
  int m = 0, k = 0;
  int hadamard = 0;
  int8_t* packed = nullptr;  // [qact_packed_bytes]; 64-byte alignment recommended (AMX loads)
  float* scale = nullptr;    // [m_padded] per-row dequantisation scale (padding rows: 0)
  int32_t* rowsum = nullptr; // [m_padded][k/64] per-row, per-64-block code sums (padding rows: 0)
};
size_t qact_packed_bytes(int m, int k);
size_t qact_rowsum_count(int m, int k);
int qact_padded_rows(int m);

// x: m rows of k floats, row stride ldx. k % 64 == 0 (and % 128 when hadamard = 128).
// out->packed/scale/rowsum must be set by the caller; m, k, hadamard are filled in.
void quantize_activations(const float* x, int ldx, int m, int k, int hadamard, QAct* out, ThreadPool* pool);
// The same on zmm (activations_avx512.cpp, AVX-512F/BW): call only when the CPU has AVX-512 (the VNNI and AMX
// backends). BIT-IDENTICAL to quantize_activations(): the transform's butterflies, the f32 division by the scale and
// the round-half-even conversion are the same operations on every element, only 16 at a time.
void quantize_activations_avx512(const float* x, int ldx, int m, int k, int hadamard, QAct* out, ThreadPool* pool);
// The same on rows made on the fly: fill(ctx, r, row) writes row r (k floats) and must depend on r alone (it may run
// on any thread, and more than once per row). Each row goes straight from its producer (an RMS norm, a GELU) into
// the quantiser through an L1-resident buffer instead of through an m x k array in memory. k <= kRowSourceMaxK.
struct RowSource {
  void (*fill)(const void* ctx, int r, float* row);
  const void* ctx;
};
constexpr int kRowSourceMaxK = 16384;
void quantize_activations_from(const RowSource& src, int m, int k, int hadamard, QAct* out, ThreadPool* pool);
void quantize_activations_from_avx512(const RowSource& src, int m, int k, int hadamard, QAct* out,
                                      ThreadPool* pool);

// y[m, n] (row stride ldy) = dequantised x · Wᵀ. a.hadamard must equal w.hadamard.
// Work is split over the pool in tasks of whole 16-column blocks (each task owns disjoint
// output columns), so the result does not depend on the thread count. pool may be null.
void gemm(const QAct& a, const QLinear& w, float* y, int ldy, ThreadPool* pool);
// The same on an explicit backend (tests, benchmarks). Throws std::runtime_error when the CPU
// cannot run it.
void gemm(const QAct& a, const QLinear& w, float* y, int ldy, ThreadPool* pool, Backend b);

// Several GEMMs of the same activations (a.hadamard equal to every w's) in ONE pool dispatch: their 16-column
// blocks form one task list that the threads share, so a step pays one wake-up and one barrier for e.g. q, k and v
// (or gate and up) instead of one each, and a GEMM too narrow to keep every thread busy (k, v: 256 columns) shares
// its dispatch with a wide one. Each output gets the bits gemm() would give it.
struct GemmTarget {
  const QLinear* w;
  float* y;
  int ldy;
};
void gemm_multi(const QAct& a, const GemmTarget* targets, int n, ThreadPool* pool, Backend b);

// Weight-only int8 on a q8g weight (docs/fgm-extensions.md): y[m, n] = Σ_g s[g][n] · Σ_{k in group g} x[m, k] · code
// with x in f32 (no rotation, no quantisation), as: acc = +0; for each group g in order { p = +0; for k in the group,
// ascending: p = fmaf(x[m, k], (float)code, p); acc = fmaf(p, s[g][n], acc) }; y = acc. The AVX2 backend runs it
// with ymm, the VNNI and AMX backends with zmm (one panel a register); every lane follows that sequence, so all
// backends give the same bits. Work is split over the pool in whole 16-column panels, so the result depends neither
// on the thread count nor on m.
// With offsets (a q8ga weight, W[n, k] = fl(fl(code · s[g][n]) + o[g][n])) the offsets get a chain of their own:
// xs_g = the group's sum of x[m, k] in f32 adds: lanes t[j] = Σ_i x[gG + 8i + j] (i ascending, from +0) over its
// first 8·⌊G/8⌋ values, then ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)), then the other values one by one
// in order; off = +0; for each group g in order:
// off = fmaf(xs_g, o[g][n], off); y = acc + off (one f32 add). For x = a unit row e_k this returns
// fl(code · s + o), the stored value of W[n, k].
//
// With int8 activations (Q8gInput::Int8, the engine's default on every backend: the int8 multiply rate is 4x the f32
// FMA rate on an AVX-512 VNNI core, ~2x on AVX2 (vpmaddubsw on the sign trick, exact on these codes)) x is quantised
// per row in blocks of 32 inputs, as llama.cpp quantises activations against GGUF weights (Q8_0 blocks of 32) and so
// no coarser:
//   amax = max |x[m, 32b .. 32b+31]|; a[m][b] = amax / 127.0f (f32 division), or 1 when amax = 0;
//   code = clamp(round_half_even(x / a[m][b]), -127, 127) (f32 division);
// then over units of U inputs (U = 16 when G = 16, else 32: each unit lies in one activation block and one group),
//   acc_u[m, n] = the exact int32 sum over unit u of code · q;
//   y = +0; for each unit u in order: y = fmaf((float)acc_u, fl(a[m][uU/32] · s[uU/G][n]), y);
// and a q8ga weight's offsets chain as above, on the f32 x. A weight whose group is neither 16 nor a multiple of 32
// (or K % 32 != 0) runs the f32 contract whatever the input. Bit-identical on every backend, as the f32 one.
enum class Q8gInput : int { F32 = 0, Int8 = 1 };
// Whether a q8g weight of K inputs and group G runs on int8 activations when asked: G is 16 or a multiple of 32
// (units of 16 or 32 inputs within one activation block and one group) and K % 32 == 0.
inline bool q8g_runs_int8(int k, int group) { return k % 32 == 0 && (group == 16 || (group > 0 && group % 32 == 0)); }
Q8gInput q8g_input_from_name(const std::string& name);  // "int8" | "f32"; std::invalid_argument otherwise
const char* q8g_input_name(Q8gInput in);
void gemm_q8g(const float* x, int ldx, int m, const QLinear& w, float* y, int ldy, ThreadPool* pool, Q8gInput in);
// The same on an explicit backend. Throws std::runtime_error when the CPU cannot run it.
void gemm_q8g(const float* x, int ldx, int m, const QLinear& w, float* y, int ldy, ThreadPool* pool, Backend b,
              Q8gInput in);
// Several q8g GEMMs of the same x (q, k and v; gate and up) in ONE pool dispatch, as gemm_multi: each output gets
// the bits gemm_q8g would give it (with int8 activations, x is quantised once for all of them).
void gemm_q8g_multi(const float* x, int ldx, int m, const GemmTarget* targets, int n, ThreadPool* pool, Backend b,
                    Q8gInput in);

// In-place normalised fast Walsh–Hadamard transform of every contiguous 128-block of x[0..n)
// (n % 128 == 0): x·H with H = H₁₂₈/√128 in Sylvester order.
void fwht128(float* x, int n);

}  // namespace sg
