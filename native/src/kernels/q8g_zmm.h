// zmm pieces of the q8g GEMM: the scales' loads, the panel transposition its VNNI kernels (gemm_q8g_avx512.cpp) want
// (the AMX kernel, gemm_q8g_amx.cpp, does it in one vpermb) and the offsets' epilogue (q8ga) of both. Internal
// linkage on purpose, as q8g_driver.h: each translation unit compiles its own copy with its own ISA flags.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "gemm.h"

namespace sg::detail {
namespace {

// 16 scales from s on, as f32 (f16 ones widened: exact).
inline __m512 load_scales16(Q8gScales s) {
  return s.f16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.p)))
               : _mm512_loadu_ps(static_cast<const float*>(s.p));
}

// One 64-byte load of a panel holds 4 inputs (k .. k+3) × its 16 columns, input-major; vpdpbusd and tdpbssd both
// want each column's 4 inputs in one dword (a tile row of B: 16 columns × 4 inputs). In two shuffles, since the VNNI
// backend runs on CPUs without AVX512-VBMI (Cascade Lake): vpermd gathers into 128-bit lane L the dwords of columns
// 4L .. 4L+3 of each input, vpshufb then transposes each lane's 4 × 4 bytes (AVX-512 F/BW).
alignas(64) constexpr int32_t kAcrossLanes[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
alignas(64) constexpr int8_t kWithinLane[64] = {0, 4, 8,  12, 1, 5, 9,  13, 2, 6, 10, 14, 3, 7, 11, 15,
                                                0, 4, 8,  12, 1, 5, 9,  13, 2, 6, 10, 14, 3, 7, 11, 15,
                                                0, 4, 8,  12, 1, 5, 9,  13, 2, 6, 10, 14, 3, 7, 11, 15,
                                                0, 4, 8,  12, 1, 5, 9,  13, 2, 6, 10, 14, 3, 7, 11, 15};

struct PanelTranspose {
  __m512i across = _mm512_loadu_si512(kAcrossLanes), within = _mm512_loadu_si512(kWithinLane);
  __m512i operator()(__m512i raw) const { return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(across, raw), within); }
};

// y[i][16p .. 16p+15] += the offsets' chain of gemm.h (q8ga), after the groups, as the AVX2 kernels add it.
template <int MR, int NP>
void add_offsets_zmm(const float* offsets, const float* xsum, int n_total, int k_total, int group, float* y,
                     int ldy) {
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

}  // namespace
}  // namespace sg::detail
