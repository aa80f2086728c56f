// The activation quantisers' codes, round-half-even(fl(x / s)) (gemm.h defines them by the f32 division), without a
// division per element: a multiply by fl(1/s) instead of a vdivps per register. The quantiser alone took 0.90-0.93x
// the time (zmm, 1024 rows, K=1536); in the model its Hadamard butterflies are the larger cost, and E2B prefill's
// act_quant moved 2-3% (docs/benchmarks.md, session 20).
//
// Why the multiply gives the same integers: the quantisers divide values |x| <= amax by s = fl(amax / 127), so
// |x / s| < 128. There fl(1/s) is within 2^-24 (relative) of 1/s, so x · fl(1/s) is within 128 · 2^-24 = 2^-17 of
// x / s, and rounding it to t adds at most half an ulp below 128, 2^-18; the division's fl(x / s) is itself within
// 2^-18 of x / s. Where t lies more than 2^-15 from every half-integer, x / s, t and fl(x / s) are all strictly on
// the same side of each one, so t and fl(x / s) round to the same integer (and neither is a tie). A register with a
// lane closer than that (~1 lane in 16000), or a lane that is not finite (s so small that fl(1/s) overflows, an
// infinite or NaN input), divides after all, every lane, exactly as before.
//
// Internal linkage on purpose, as q8g_driver.h: each translation unit compiles its own copy with its own ISA flags.
#pragma once

#include <immintrin.h>

namespace sg::detail {
namespace {

// |t − round(t)| at or above this, or unordered, and the register divides.
constexpr float kQuotientNearHalf = 0.5f - 1.0f / 32768.0f;

// The int32 codes (before the clamp to ±127) of 8 values over one scale.
struct QuotientCodes256 {
  __m256 s, r;
  explicit QuotientCodes256(float scale) : s(_mm256_set1_ps(scale)), r(_mm256_set1_ps(1.0f / scale)) {}
  __m256i operator()(__m256 x) const {
    const __m256 t = _mm256_mul_ps(x, r);
    const __m256i n = _mm256_cvtps_epi32(t);
    const __m256 d = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(t, _mm256_cvtepi32_ps(n)));
    if (_mm256_movemask_ps(_mm256_cmp_ps(d, _mm256_set1_ps(kQuotientNearHalf), _CMP_NLT_UQ))) [[unlikely]]
      return _mm256_cvtps_epi32(_mm256_div_ps(x, s));
    return n;
  }
};

#ifdef __AVX512F__
// The same for 16 values.
struct QuotientCodes512 {
  __m512 s, r;
  explicit QuotientCodes512(float scale) : s(_mm512_set1_ps(scale)), r(_mm512_set1_ps(1.0f / scale)) {}
  __m512i operator()(__m512 x) const {
    const __m512 t = _mm512_mul_ps(x, r);
    const __m512i n = _mm512_cvtps_epi32(t);
    const __m512 d = _mm512_abs_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(n)));
    if (_mm512_cmp_ps_mask(d, _mm512_set1_ps(kQuotientNearHalf), _CMP_NLT_UQ)) [[unlikely]]
      return _mm512_cvtps_epi32(_mm512_div_ps(x, s));
    return n;
  }
};
#endif

}  // namespace
}  // namespace sg::detail
