// The q8g weight-only GEMM with AVX-512 (F + BW + VL), for the VNNI and AMX backends' hosts: one zmm is one whole
// 16-column panel, and the 32 registers hold twice the accumulators of the AVX2 kernel (gemm_q8g.cpp). Each output
// lane runs exactly the AVX2 kernel's sequence (p = fma(x, code, p) for k ascending within a group, then
// acc = fma(p, s, acc)), so the two give the same bits; the emulated test build checks that on any CPU.
#include <immintrin.h>

#include <cstdint>

#include "kernels_impl.h"
#include "q8g_driver.h"

namespace sg::detail {
namespace {

// Decode (at most kDecodeRows rows): up to 12 rows a register block (M=8 in one block, M=32 in three of 11, 11 and
// 10): every weight vector is widened to f32 once per row block, so the more rows share it, the fewer conversions
// each FMA carries (6 rows × 2 panels spent 4 conversion uops per 12 FMAs, 8 × 3 spends 6 per 24).
constexpr int kMaxRows = 12;

// acc lives in y (read, fma, written back once per group: 1/group of the FMAs) so that the 32 zmm hold MR·NP part
// chains, NP weight vectors and a broadcast. Storing the f32 and reading it back is exact, so the sequence per
// output is the AVX2 kernel's (acc = +0, then acc = fma(p, s, acc) per group).
// Streaming: `codes + NP panels` is what the driver walks next (M=1: the next block; several rows: the next panel
// block after the other row blocks); its codes and scales are prefetched into L2 at the rate this block reads its
// own (NP·16 bytes a k step), one block (NP·K·16 bytes: 40 KB for 4 panels of K=640) ahead. The mmap'd weights
// sit on 4 KB pages where the hardware prefetcher stops, so without this each thread streamed at its DRAM latency.
template <int MR, int NP, bool OFF>
void q8g_block_zmm(const float* x, int ldx, const int8_t* codes, const float* scales, const float* offsets,
                   const float* xsum, int n_total, int k_total, int group, float* y, int ldy) {
  const size_t panel_bytes = size_t(k_total) * 16;
  const int8_t* next = codes + NP * panel_bytes;
  for (int k0 = 0, g = 0; k0 < k_total; k0 += group, ++g) {
    const float* s = scales + size_t(g) * n_total;
    for (int p = 0; p < NP; ++p) _mm_prefetch(reinterpret_cast<const char*>(s + 16 * (NP + p)), _MM_HINT_T1);
    __m512 part[MR][NP];
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) part[i][p] = _mm512_setzero_ps();
    for (int k = k0; k < k0 + group; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(next + size_t(k) * (NP * 16)), _MM_HINT_T1);
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
      const __m512 sv = _mm512_loadu_ps(s + 16 * p);
      for (int i = 0; i < MR; ++i) {
        float* yo = y + size_t(i) * ldy + 16 * p;
        const __m512 acc = g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yo);
        _mm512_storeu_ps(yo, _mm512_fmadd_ps(part[i][p], sv, acc));
      }
    }
  }
  if constexpr (OFF) {  // q8ga: the offsets' own chain after the groups, then one add, as the AVX2 kernel
    const int ng = k_total / group;
    __m512 off[MR][NP];
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) off[i][p] = _mm512_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      const float* o = offsets + size_t(g) * n_total;
      for (int p = 0; p < NP; ++p) _mm_prefetch(reinterpret_cast<const char*>(o + 16 * (NP + p)), _MM_HINT_T1);
      for (int p = 0; p < NP; ++p) {
        const __m512 ov = _mm512_loadu_ps(o + 16 * p);
        for (int i = 0; i < MR; ++i)
          off[i][p] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[size_t(i) * ng + g]), ov, off[i][p]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) {
        float* yo = y + size_t(i) * ldy + 16 * p;
        _mm512_storeu_ps(yo, _mm512_add_ps(_mm512_loadu_ps(yo), off[i][p]));
      }
  }
}

// Panels per block for MR rows: MR·NP part chains plus NP weight vectors and a broadcast within the 32 zmm, and at
// least 4 chains for one row (the FMA latency). kPanelBlock (12) is a multiple of every entry.
constexpr int kPanelsFor[kMaxRows + 1] = {0, 4, 4, 4, 4, 4, 4, 3, 3, 2, 2, 2, 2};
template <bool OFF>
constexpr Q8gBlockFn kWide[kMaxRows + 1] = {
    nullptr,                    q8g_block_zmm<1, 4, OFF>,  q8g_block_zmm<2, 4, OFF>,  q8g_block_zmm<3, 4, OFF>,
    q8g_block_zmm<4, 4, OFF>,   q8g_block_zmm<5, 4, OFF>,  q8g_block_zmm<6, 4, OFF>,  q8g_block_zmm<7, 3, OFF>,
    q8g_block_zmm<8, 3, OFF>,   q8g_block_zmm<9, 2, OFF>,  q8g_block_zmm<10, 2, OFF>, q8g_block_zmm<11, 2, OFF>,
    q8g_block_zmm<12, 2, OFF>};
template <bool OFF>
constexpr Q8gBlockFn kOne[kMaxRows + 1] = {
    nullptr,                    q8g_block_zmm<1, 1, OFF>,  q8g_block_zmm<2, 1, OFF>,  q8g_block_zmm<3, 1, OFF>,
    q8g_block_zmm<4, 1, OFF>,   q8g_block_zmm<5, 1, OFF>,  q8g_block_zmm<6, 1, OFF>,  q8g_block_zmm<7, 1, OFF>,
    q8g_block_zmm<8, 1, OFF>,   q8g_block_zmm<9, 1, OFF>,  q8g_block_zmm<10, 1, OFF>, q8g_block_zmm<11, 1, OFF>,
    q8g_block_zmm<12, 1, OFF>};

// Prefill (more rows than a decode batch): blocks of at most 6 rows (the 12-row ones measured slower there,
// docs/benchmarks.md, "Gemma 3 270M decode") × 4 panels: 24 FMA chains, 4 weight vectors and a broadcast in the 32
// zmm: per k, 6 broadcasts and 4 conversions for 24 FMAs, where 6 × 2 spent 6 and 2 on 12. At M=256-512 on Zen 4
// (one thread, in-process A/B) 6 × 4 took 0.83-0.93 of the time of 6 × 2; 8 × 3 0.89-0.98.
constexpr int kDecodeRows = 32, kPrefillRows = 6;
constexpr int kPanelsForPrefill[kPrefillRows + 1] = {0, 4, 4, 4, 4, 4, 4};
template <bool OFF>
constexpr Q8gBlockFn kWidePrefill[kPrefillRows + 1] = {
    nullptr, q8g_block_zmm<1, 4, OFF>, q8g_block_zmm<2, 4, OFF>, q8g_block_zmm<3, 4, OFF>,
    q8g_block_zmm<4, 4, OFF>, q8g_block_zmm<5, 4, OFF>, q8g_block_zmm<6, 4, OFF>};

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
  constexpr int kPanelBlock = 12;  // a multiple of the 4/3/2 panels a block takes; 120 KB of codes at K=640
  if (m > kDecodeRows)
    q8g_drive(Q8gKernels{kPrefillRows, kPanelBlock, kPanelsForPrefill, kWidePrefill<false>, kOne<false>,
                         kWidePrefill<true>, kOne<true>},
              x, ldx, m, w, xsum, y, ldy, p0, p1);
  else
    q8g_drive(Q8gKernels{kMaxRows, kPanelBlock, kPanelsFor, kWide<false>, kOne<false>, kWide<true>, kOne<true>}, x,
              ldx, m, w, xsum, y, ldy, p0, p1);
}

}  // namespace sg::detail
