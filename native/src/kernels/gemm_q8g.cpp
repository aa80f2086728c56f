// Weight-only int8 GEMM on q8g weights (docs/fgm-extensions.md), compiled with -mavx2 -mfma -mf16c.
//
// The activations stay f32: a q8g model is small enough that the int8 × int8 GEMMs' speed matters less than not
// requantising its activations. One 16-byte row of a panel holds the codes of its 16 output columns at one k; they
// are widened to two ymm of f32 and each of MR activation rows adds x[m, k] · code to the group's partial sum with one
// FMA per column, k ascending; at the group's end acc = fma(partial, s[g], acc). That sequence per output is fixed
// by the format (gemm.h), not by the blocking, so every row count and thread count gives the same bits, and so does
// the AVX-512 kernel (gemm_q8g_avx512.cpp), whose lanes run the same sequences. A q8ga weight (with offsets) adds,
// after the groups, a second chain off = fma(Σx over group g, o[g], off) over g and then y = acc + off: outside the
// hot loop, whose registers it would otherwise crowd.
#include <immintrin.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels_impl.h"
#include "q8g_driver.h"

namespace sg::detail {
namespace {

// Register blocks: MR activation rows × NP panels (16 columns each) keep MR·NP·2 accumulators; with the two weight
// vectors and one broadcast that must fit the 16 ymm registers. Each accumulator is one FMA chain (k ascending, the
// format's order), so few rows need several panels in flight to hide the FMA latency: decode (1-3 rows) is bound
// by that latency otherwise, prefill by the FMA ports.
constexpr int kMaxRows = 6;

template <int MR, int NP, bool OFF>
void q8g_block(const float* x, int ldx, const int8_t* codes, const float* scales, const float* offsets,
               const float* xsum, int n_total, int k_total, int group, float* y, int ldy) {
  const size_t panel_bytes = size_t(k_total) * 16;
  // acc is touched once per group (and spilled by the compiler when MR·NP is large); part is the hot FMA chain.
  __m256 acc[MR][NP][2];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) acc[i][p][0] = acc[i][p][1] = _mm256_setzero_ps();
  for (int k0 = 0; k0 < k_total; k0 += group) {
    __m256 part[MR][NP][2];
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) part[i][p][0] = part[i][p][1] = _mm256_setzero_ps();
    for (int k = k0; k < k0 + group; ++k) {
      for (int p = 0; p < NP; ++p) {
        const int8_t* c = codes + p * panel_bytes + size_t(k) * 16;
        const __m128i* lo = reinterpret_cast<const __m128i*>(c);      // columns 0-7 of the panel
        const __m128i* hi = reinterpret_cast<const __m128i*>(c + 8);  // columns 8-15
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(lo)));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(hi)));
        for (int i = 0; i < MR; ++i) {
          const __m256 a = _mm256_broadcast_ss(x + size_t(i) * ldx + k);
          part[i][p][0] = _mm256_fmadd_ps(a, w0, part[i][p][0]);
          part[i][p][1] = _mm256_fmadd_ps(a, w1, part[i][p][1]);
        }
      }
    }
    const float* s = scales + size_t(k0 / group) * n_total;
    for (int p = 0; p < NP; ++p) {
      const __m256 s0 = _mm256_loadu_ps(s + 16 * p), s1 = _mm256_loadu_ps(s + 16 * p + 8);
      for (int i = 0; i < MR; ++i) {
        acc[i][p][0] = _mm256_fmadd_ps(part[i][p][0], s0, acc[i][p][0]);
        acc[i][p][1] = _mm256_fmadd_ps(part[i][p][1], s1, acc[i][p][1]);
      }
    }
  }
  if constexpr (OFF) {  // q8ga: + Σ_g (Σx over group g) · o[g], its own chain, after the loop (gemm.h)
    const int ng = k_total / group;
    __m256 off[MR][NP][2];
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) off[i][p][0] = off[i][p][1] = _mm256_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      const float* o = offsets + size_t(g) * n_total;
      for (int p = 0; p < NP; ++p) {
        const __m256 o0 = _mm256_loadu_ps(o + 16 * p), o1 = _mm256_loadu_ps(o + 16 * p + 8);
        for (int i = 0; i < MR; ++i) {
          const __m256 xs = _mm256_broadcast_ss(xsum + size_t(i) * ng + g);
          off[i][p][0] = _mm256_fmadd_ps(xs, o0, off[i][p][0]);
          off[i][p][1] = _mm256_fmadd_ps(xs, o1, off[i][p][1]);
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) {
        acc[i][p][0] = _mm256_add_ps(acc[i][p][0], off[i][p][0]);
        acc[i][p][1] = _mm256_add_ps(acc[i][p][1], off[i][p][1]);
      }
  }
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) {
      _mm256_storeu_ps(y + size_t(i) * ldy + 16 * p, acc[i][p][0]);
      _mm256_storeu_ps(y + size_t(i) * ldy + 16 * p + 8, acc[i][p][1]);
    }
}

// Panels per block for MR rows, and the kernels for each MR with that many and with one panel (the remainder of a
// panel range). Measured on Zen 3 (bench/bench_gemm.py, LM head N=262144 at M=1): 3 panels for one row beat 1 (too
// few FMA chains) and 6 (spills, and six weight streams at once); 2 for two rows.
constexpr int kPanelsFor[kMaxRows + 1] = {0, 3, 2, 1, 1, 1, 1};
template <bool OFF>
constexpr Q8gBlockFn kWide[kMaxRows + 1] = {nullptr,
                                            q8g_block<1, 3, OFF>, q8g_block<2, 2, OFF>, q8g_block<3, 1, OFF>,
                                            q8g_block<4, 1, OFF>, q8g_block<5, 1, OFF>, q8g_block<6, 1, OFF>};
template <bool OFF>
constexpr Q8gBlockFn kOne[kMaxRows + 1] = {nullptr,
                                           q8g_block<1, 1, OFF>, q8g_block<2, 1, OFF>, q8g_block<3, 1, OFF>,
                                           q8g_block<4, 1, OFF>, q8g_block<5, 1, OFF>, q8g_block<6, 1, OFF>};

}  // namespace

void q8g_group_sums(const float* x, int ldx, int m, int k, int group, float* xs) {
  // gemm.h's order: eight lanes t[j] = Σ_i x[8i + j] over the group's first 8·⌊G/8⌋ values (i ascending, from +0),
  // then ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)), then the last G mod 8 values one by one.
  const int ng = k / group, full = group / 8 * 8;
  for (int i = 0; i < m; ++i)
    for (int g = 0; g < ng; ++g) {
      const float* r = x + size_t(i) * ldx + size_t(g) * group;
      __m256 t = _mm256_setzero_ps();
      for (int j = 0; j < full; j += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(r + j));
      alignas(32) float l[8];
      _mm256_store_ps(l, t);
      float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
      for (int j = full; j < group; ++j) s += r[j];
      xs[size_t(i) * ng + g] = s;
    }
}

void gemm_q8g_panels(const float* x, int ldx, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0,
                     int p1) {
  constexpr int kPanelBlock = 6;  // 6 panels of K=2048: 192 KB of codes, within Zen 3's 512 KB L2
  q8g_drive(Q8gKernels{kMaxRows, kPanelBlock, kPanelsFor, kWide<false>, kOne<false>, kWide<true>, kOne<true>}, x,
            ldx, m, w, xsum, y, ldy, p0, p1);
}

}  // namespace sg::detail
