// The q8g weight-only GEMM with AVX-512 (F + BW + VL), for the VNNI and AMX backends' hosts: one zmm is one whole
// 16-column panel, and the 32 registers hold twice the accumulators of the AVX2 kernel (gemm_q8g.cpp). Each output
// lane runs exactly the AVX2 kernel's sequence (p = fma(x, code, p) for k ascending within a group, then
// acc = fma(p, s, acc)), so the two give the same bits; the emulated test build checks that on any CPU.
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels_impl.h"
#include "q8g_driver.h"
#include "q8g_zmm.h"

namespace sg::detail {
namespace {

// The f32 kernel's decode blocks (at most kDecodeRows rows): up to 12 rows a register block (M=8 in one block, M=32
// in three of 11, 11 and 10): every weight vector is widened to f32 once per row block, so the more rows share it,
// the fewer conversions each FMA carries (6 rows × 2 panels spent 4 conversion uops per 12 FMAs, 8 × 3 spends 6
// per 24).
constexpr int kMaxRows = 12;

// The kernels below keep each output's running sum in memory between groups (the registers hold the hot chains), in
// a tile on the stack rather than in y itself: y's rows lie N floats apart, and at N = 2048 or 4096 (Gemma 3 270M's
// FFN projections) that is a multiple of 4 KB, so every row's sums share their low 12 address bits and a group's
// loads can wait on other rows' stores (4K aliasing). Int8 activations, 32 rows, K=640, in one process alternated
// call by call on Zen 5: N=2048 0.94x the time in the tile, N=4096 0.92x; the LM head (N=262144) alike (1.01x).
// The tile goes to y once, at the end.
template <int MR, int NP>
void store_tile(const float (&tile)[MR][NP][16], float* y, int ldy) {
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(y + size_t(i) * ldy + 16 * p, _mm512_load_ps(tile[i][p]));
}

// The f32 kernel. acc lives in memory (read, fma, written back once per group: 1/group of the FMAs) so that the 32
// zmm hold MR·NP part chains, NP weight vectors and a broadcast. Storing the f32 and reading it back is exact, so the
// sequence per output is the AVX2 kernel's (acc = +0, then acc = fma(p, s, acc) per group). That memory is a tile
// on the stack, copied to y at the end (q8g_fold_tile).
// Streaming: the next panels' scales are prefetched one block ahead, their codes as the driver shares them out
// (q8g_driver.h), trickled over the k steps.
template <int MR, int NP, bool OFF>
void q8g_block_zmm(const F32Rows& rows, const int8_t* codes, Q8gScales scales, const float* offsets,
                   const float* xsum, int n_total, int k_total, int group, float* y, int ldy, const int8_t* pf,
                   size_t pf_bytes) {
  const float* x = rows.x;
  const int ldx = rows.ldx;
  const size_t panel_bytes = size_t(k_total) * 16;
  PrefetchTrickle next(pf, pf_bytes, size_t(k_total));
  alignas(64) float tile[MR][NP][16];
  for (int k0 = 0, g = 0; k0 < k_total; k0 += group, ++g) {
    const Q8gScales s = scales + size_t(g) * n_total;
    prefetch_next_scales<NP>(s);
    __m512 part[MR][NP];
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) part[i][p] = _mm512_setzero_ps();
    for (int k = k0; k < k0 + group; ++k) {
      next.step();
      __m512 wv[NP];
      for (int p = 0; p < NP; ++p)
        wv[p] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * panel_bytes + size_t(k) * 16))));
      for (int i = 0; i < MR; ++i) {
        const __m512 a = _mm512_set1_ps(x[size_t(i) * ldx + k]);
        for (int p = 0; p < NP; ++p) part[i][p] = _mm512_fmadd_ps(a, wv[p], part[i][p]);
      }
    }
    for (int p = 0; p < NP; ++p) {
      const __m512 sv = load_scales16(s + 16 * p);
      for (int i = 0; i < MR; ++i) {
        const __m512 acc = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(tile[i][p]);
        _mm512_store_ps(tile[i][p], _mm512_fmadd_ps(part[i][p], sv, acc));
      }
    }
  }
  store_tile<MR, NP>(tile, y, ldy);
  if constexpr (OFF) add_offsets_zmm<MR, NP>(offsets, xsum, n_total, k_total, group, y, ldy);
}

// The int8-activation kernel (gemm.h, Q8gInput::Int8): vpdpbusd, 64 multiply-adds a lane group, 4x the f32 FMAs.
// vpdpbusd wants each column's 4 inputs in one dword, so each 64-byte load of a panel is transposed (PanelTranspose,
// q8g_zmm.h).
// vpdpbusd multiplies unsigned by signed bytes, so the weight codes are flipped to code + 128 (one xor) and each
// unit's int32 sum starts at -128 · the activations' code sum (Q8gActs.bias16/32): it ends exact, the sum of gemm.h.
// Then per unit y = fma((float)acc, a·s, y) with y in a tile in memory (read, fma, written once a unit), as the AVX2
// kernel.
struct VnniOrder {
  PanelTranspose transpose;
  __m512i flip = _mm512_set1_epi8(char(0x80));
  // 64 bytes of a panel (inputs k .. k+3 × 16 columns, input-major) as vpdpbusd's unsigned operand.
  __m512i operator()(__m512i raw) const { return _mm512_xor_si512(transpose(raw), flip); }
};

// A prefill chunk's row blocks would each transpose the same panels: the driver has them rewritten once per panel
// block into its scratch (q8g_driver.h), which the REPACKED kernels (the prefill ones) load as they are. Same
// operands, so the same bits.
// Gemma 3 270M's shapes, int8 activations, 2 threads, in one process alternated call by call on Zen 5: at M=256
// 0.92-0.93x the time (N=2048 K=640, N=1024 K=640, N=640 K=2048), at M=64 0.99x. Not for decode batches: at M=16
// and 32 (2 and 4 row blocks) the rewrite cost what it saved (1.02-1.07x, LM head and FFN shapes).
void repack_vnni(const int8_t* codes, size_t bytes, int8_t* out) {
  const VnniOrder order;
  for (size_t o = 0; o < bytes; o += 64) _mm512_store_si512(out + o, order(_mm512_loadu_si512(codes + o)));
}

template <int MR, int NP, bool OFF, int U, bool REPACKED>
void q8g_int8_block_zmm(const Int8Rows& rows, const int8_t* codes, Q8gScales scales, const float* offsets,
                        const float* xsum, int n_total, int k_total, int group, float* y, int ldy, const int8_t* pf,
                        size_t pf_bytes) {
  const size_t panel_bytes = size_t(k_total) * 16;
  const Q8gActs& a = *rows.a;
  const int8_t* xc = a.codes + size_t(rows.m0) * k_total;  // this block's codes: step k/4 at + (k/4)·4·MR
  const float* as = a.scale + rows.m0;              // block b at + b·m
  const int32_t* bias = (U == 16 ? a.bias16 : a.bias32) + rows.m0;  // unit u at + u·m
  const VnniOrder order;
  PrefetchTrickle next(pf, pf_bytes, size_t(k_total / 4));
  alignas(64) float tile[MR][NP][16];
  for (int k0 = 0, u = 0; k0 < k_total; k0 += U, ++u) {
    const Q8gScales s = scales + size_t(k0 / group) * n_total;
    if (k0 % group == 0) prefetch_next_scales<NP>(s);
    __m512i acc[MR][NP];
    for (int i = 0; i < MR; ++i) {
      const __m512i b = _mm512_set1_epi32(bias[size_t(u) * a.m + i]);
      for (int p = 0; p < NP; ++p) acc[i][p] = b;
    }
    // A compile-time trip count, unrolled: GCC keeps the sums in registers only in straight-line code (with a
    // run-time bound it copied and stored every sum each step).
#pragma GCC unroll 8
    for (int kk = 0; kk < U; kk += 4) {
      const int k = k0 + kk;
      const int8_t* xk = xc + size_t(k / 4) * 4 * MR;
      next.step();
      __m512i wv[NP];
      for (int p = 0; p < NP; ++p) {
        const int8_t* c = codes + p * panel_bytes + size_t(k) * 16;
        wv[p] = REPACKED ? _mm512_load_si512(c) : order(_mm512_loadu_si512(c));
      }
      for (int i = 0; i < MR; ++i) {
        int32_t quad;
        std::memcpy(&quad, xk + 4 * i, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], wv[p], xb);
      }
    }
    for (int p = 0; p < NP; ++p) {
      const __m512 sv = load_scales16(s + 16 * p);
      for (int i = 0; i < MR; ++i) {
        const __m512 sc = _mm512_mul_ps(sv, _mm512_set1_ps(as[size_t(k0 / 32) * a.m + i]));
        const __m512 prev = u == 0 ? _mm512_setzero_ps() : _mm512_load_ps(tile[i][p]);
        _mm512_store_ps(tile[i][p], _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][p]), sc, prev));
      }
    }
  }
  store_tile<MR, NP>(tile, y, ldy);
  if constexpr (OFF) add_offsets_zmm<MR, NP>(offsets, xsum, n_total, k_total, group, y, ldy);
}

// Panels per block for MR rows: MR·NP part chains plus NP weight vectors and a broadcast within the 32 zmm, and at
// least 4 chains for one row (the FMA latency). kPanelBlock (12) is a multiple of every entry.
constexpr int kPanelsFor[kMaxRows + 1] = {0, 4, 4, 4, 4, 4, 4, 3, 3, 2, 2, 2, 2};

// The dispatch tables: entry mr (1 .. R) is Kernel::fn<mr, panels[mr]>, or Kernel::fn<mr, 1> for the remainder of a
// panel range (kOne*), so each block shape is written once, in its panels array.
template <bool OFF>
struct F32Kernel {
  template <int MR, int NP>
  static constexpr Q8gBlockFn<F32Rows> fn = q8g_block_zmm<MR, NP, OFF>;
};
template <bool OFF, int U, bool REPACKED>
struct Int8Kernel {
  template <int MR, int NP>
  static constexpr Q8gBlockFn<Int8Rows> fn = q8g_int8_block_zmm<MR, NP, OFF, U, REPACKED>;
};
template <class Kernel, const int* Panels, int... I>  // I = mr - 1; Panels null: one panel
constexpr auto block_table(std::integer_sequence<int, I...>) {
  using Fn = std::remove_const_t<decltype(Kernel::template fn<1, 1>)>;
  return std::array<Fn, sizeof...(I) + 1>{nullptr, Kernel::template fn<I + 1, Panels ? Panels[I + 1] : 1>...};
}
template <class Kernel, const int* Panels, int R>
constexpr auto kTable = block_table<Kernel, Panels>(std::make_integer_sequence<int, R>{});

template <bool OFF>
constexpr auto kWide = kTable<F32Kernel<OFF>, kPanelsFor, kMaxRows>;
template <bool OFF>
constexpr auto kOne = kTable<F32Kernel<OFF>, nullptr, kMaxRows>;

// The int8 kernel: MR·NP int32 sums, NP weight vectors, three constants and a broadcast in the 32 zmm. The
// broadcast is one vpbroadcastd a row and step, shared by the NP panels: as vpdpbusd's embedded broadcast of a
// memory operand instead (inline asm), the kernel took 1.9x the time on Zen 5. Few rows take fewer panels than the
// f32 kernel: at one row this kernel is bound by the DRAM stream, and its 4 panels (4 codes streams, one line a step
// each) streamed slower than the f32 kernel's, whose 4 streams advance a line per 4 steps. LM head (262144 x 640)
// from DRAM, int8/f32 time, alternated in one process on Zen 5: 1 row 1.19-1.26 with 4 panels, 1.44-1.86 with 8,
// 1.00-1.18 with 2, 1.01-1.10 with 1; 2-6 rows with 4 panels 1.18 (4 rows), with 3: 1.02 / 0.89 / 0.70 (2/4/6 rows).
// Five to eight rows take 2 panels (16 sums), not 3 (24): the 8-row block is every block of a 16- or 32-row decode
// batch, and with 24 int32 chains the kernel ran at 0.62 of the one-thread vpdpbusd peak on Zen 4 even with the
// weights cached, the transposition and the fold knocked out made no or 17% difference, and 12 rows × 2 panels (24
// chains again) was as slow; 8 × 2 took 0.87-0.89x the time (Gemma 3 270M's shapes, one thread, alternated
// processes: N=2048 K=640 at 8, 16 and 32 rows, the LM head at 8 and 32 rows; 0.83-0.90x of the FFN GEMM time in the
// model at B=8 and B=32, two threads). Not measured on Zen 5, where the 3 panels were chosen against 4, not 2.
constexpr int kPanelsForInt8[kQ8gZmmDecodeRows + 1] = {0, 2, 3, 3, 3, 2, 2, 2, 2};
template <bool OFF, int U>
constexpr auto kWideInt8 = kTable<Int8Kernel<OFF, U, false>, kPanelsForInt8, kQ8gZmmDecodeRows>;
template <bool OFF, int U, bool REPACKED>
constexpr auto kOneInt8 = kTable<Int8Kernel<OFF, U, REPACKED>, nullptr, kQ8gZmmDecodeRows>;

// Prefill (more rows than a decode batch): blocks of at most 6 rows (the 12-row ones measured slower there,
// docs/benchmarks.md, "Gemma 3 270M decode") × 4 panels: 24 FMA chains, 4 weight vectors and a broadcast in the 32
// zmm: per k, 6 broadcasts and 4 conversions for 24 FMAs, where 6 × 2 spent 6 and 2 on 12. At M=256-512 on Zen 4
// (one thread, in-process A/B) 6 × 4 took 0.83-0.93 of the time of 6 × 2; 8 × 3 0.89-0.98.
constexpr int kDecodeRows = kQ8gZmmDecodeMaxM, kPrefillRows = kQ8gZmmPrefillRows;
constexpr int kPanelBlock = 12;  // a multiple of the 4/3/2 panels a block takes; 120 KB of codes at K=640
constexpr int kPanelsForPrefill[kPrefillRows + 1] = {0, 4, 4, 4, 4, 4, 4};
template <bool OFF>
constexpr auto kWidePrefill = kTable<F32Kernel<OFF>, kPanelsForPrefill, kPrefillRows>;
// The int8 kernel's prefill blocks: 5 and 6 rows take 2 panels (12 int32 sums), as the decode blocks keep to 16 (see
// kPanelsForInt8): with 6 × 4 (24 sums) the same GEMMs took 1.12-1.3x the time on Zen 4 (M=256, Gemma 3 270M's
// N=2048 K=640, N=1024 K=640, N=640 K=2048 at groups 16 and 32; one thread and two, alternated processes); 6 × 3
// and 8 rows × 2 panels were between, 6 × 1 a little slower than 6 × 2.
constexpr int kPanelsForPrefillInt8[kPrefillRows + 1] = {0, 4, 4, 4, 4, 2, 2};
template <bool OFF, int U>  // reading the codes as repack_vnni writes them
constexpr auto kWidePrefillInt8 = kTable<Int8Kernel<OFF, U, true>, kPanelsForPrefillInt8, kPrefillRows>;

}  // namespace

uint64_t peak_loop_fma512(uint64_t iters) {
  // Ten independent zmm FMA chains (latency 4 on two ports needs eight).
  __m512 acc[10];
  for (int i = 0; i < 10; ++i) acc[i] = _mm512_set1_ps(float(i));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (uint64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 10; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  float out[16];
  for (int i = 1; i < 10; ++i) acc[0] = _mm512_fmadd_ps(acc[i], a, acc[0]);
  _mm512_storeu_ps(out, acc[0]);
  volatile float keep = out[0];
  (void)keep;
  return iters * 10 * 16 * 2;
}

void gemm_q8g_panels_avx512(const float* x, int ldx, int m, const QLinear& w, const float* xsum, float* y, int ldy,
                            int p0, int p1) {
  if (m > kDecodeRows)
    q8g_drive(Q8gKernels<F32Rows>{kPrefillRows, kPanelBlock, kPanelsForPrefill,
                                  {kWidePrefill<false>.data(), kOne<false>.data(), kWidePrefill<true>.data(),
                                   kOne<true>.data()}},
              F32Rows{x, ldx}, m, w, xsum, y, ldy, p0, p1);
  else
    q8g_drive(Q8gKernels<F32Rows>{kMaxRows, kPanelBlock, kPanelsFor,
                                  {kWide<false>.data(), kOne<false>.data(), kWide<true>.data(), kOne<true>.data()}},
              F32Rows{x, ldx}, m, w, xsum, y, ldy, p0, p1);
}

namespace {
template <int U>
constexpr Q8gFns<Int8Rows> kPrefillInt8{kWidePrefillInt8<false, U>.data(), kOneInt8<false, U, true>.data(),
                                        kWidePrefillInt8<true, U>.data(), kOneInt8<true, U, true>.data()};
template <int U>
constexpr Q8gFns<Int8Rows> kDecodeInt8{kWideInt8<false, U>.data(), kOneInt8<false, U, false>.data(),
                                       kWideInt8<true, U>.data(), kOneInt8<true, U, false>.data()};

template <int U>
void int8_panels(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0, int p1) {
  if (m > kDecodeRows)
    q8g_drive(Q8gKernels<Int8Rows>{kPrefillRows, kPanelBlock, kPanelsForPrefillInt8, kPrefillInt8<U>, repack_vnni},
              Int8Rows{&a, 0}, m, w, xsum, y, ldy, p0, p1);
  else
    q8g_drive(Q8gKernels<Int8Rows>{kQ8gZmmDecodeRows, kPanelBlock, kPanelsForInt8, kDecodeInt8<U>},
              Int8Rows{&a, 0}, m, w, xsum, y, ldy, p0, p1);
}
}  // namespace

void gemm_q8g_int8_panels_avx512(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy,
                                 int p0, int p1) {
  if (w.group == 16) int8_panels<16>(a, m, w, xsum, y, ldy, p0, p1);
  else int8_panels<32>(a, m, w, xsum, y, ldy, p0, p1);
}

}  // namespace sg::detail
