// The ymm helpers shared by the AVX2 translation units of the engine (ops_avx2.cpp, attend_rows_avx2.cpp): horizontal
// sums, e^x, and the cached K/V elements as f32. One definition, so the tile kernel's softmax rounds as attend()'s.
// Internal linkage (an unnamed namespace): include it only from translation units compiled with AVX2, FMA and F16C.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sg::ops {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x in float range: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two parts so n*ln2 is exact enough),
// e^r by its degree-7 Taylor polynomial (truncation < 6e-9 relative), times 2^n built in the exponent field.
// Inputs are clamped to [-87, 88] so 2^n stays a normal number; e^-87 ~ 1.6e-38 counts as zero for softmax.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float exp1(float x) {
  alignas(32) float b[8];
  _mm256_store_ps(b, exp8(_mm256_set1_ps(x)));
  return b[0];
}

inline __m256 load_i8_as_f32(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 cached K/V elements at byte address p as f32, E bytes each: int8 codes (E = 1; the row's scale is applied by the
// caller), f16 (2) or f32 (4).
template <int E>
inline __m256 load_kv8(const uint8_t* p, int i) {
  if constexpr (E == 4) return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
  else if constexpr (E == 2) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + i / 8));
  else return load_i8_as_f32(reinterpret_cast<const int8_t*>(p) + i);
}

}  // namespace
}  // namespace sg::ops
