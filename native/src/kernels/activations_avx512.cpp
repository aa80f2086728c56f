// quantize_activations() on zmm (gemm.h): the row quantiser of activations.cpp, 16 floats a register. Compiled
// with the VNNI flags (AVX-512F/BW, -ffp-contract=off); called only on the VNNI and AMX backends.
//
// Bit-identical to the ymm quantiser: the Hadamard butterflies run in the same stage order (strides 1, 2, ..., 64,
// the 1/√128 folded into the last stage) and every output element is the same chain of f32 adds and subtracts;
// the codes are the same integers of the f32 division by the scale (quotient_codes.h), clamped to ±127; max and the
// integer code sums do not depend on the order they are taken in.
#include <immintrin.h>

#include <cstring>

#include "gemm.h"
#include "kernels_impl.h"
#include "quantize_row.h"
#include "quotient_codes.h"

namespace sg {
namespace {

constexpr float kInvSqrt128 = 0.08838834764831845f;  // 1/√128 rounded to f32, as in activations.cpp

// One butterfly stage inside each zmm: lanes with bit `stride` clear get x[i] + x[i^stride], the others
// x[i^stride] − x[i].
inline __m512 in_lane_stage(__m512 x, __m512 swapped, __mmask16 upper) {
  return _mm512_mask_sub_ps(_mm512_add_ps(x, swapped), upper, swapped, x);
}

// x·H on 128 floats held in 8 zmm: strides 1, 2, 4, 8 inside each register, then 16, 32 and 64 between them.
inline void fwht_block(const float* src, float* dst) {
  __m512 v[8];
  for (int i = 0; i < 8; ++i) {
    __m512 x = _mm512_loadu_ps(src + 16 * i);
    x = in_lane_stage(x, _mm512_permute_ps(x, 0xB1), 0xAAAA);
    x = in_lane_stage(x, _mm512_permute_ps(x, 0x4E), 0xCCCC);
    x = in_lane_stage(x, _mm512_shuffle_f32x4(x, x, 0xB1), 0xF0F0);
    x = in_lane_stage(x, _mm512_shuffle_f32x4(x, x, 0x4E), 0xFF00);
    v[i] = x;
  }
  for (int s = 1; s < 4; s <<= 1)
    for (int i = 0; i < 8; ++i)
      if (!(i & s)) {
        const __m512 a = v[i], b = v[i + s];
        v[i] = _mm512_add_ps(a, b);
        v[i + s] = _mm512_sub_ps(a, b);
      }
  const __m512 norm = _mm512_set1_ps(kInvSqrt128);
  for (int i = 0; i < 4; ++i) {
    _mm512_storeu_ps(dst + 16 * i, _mm512_mul_ps(_mm512_add_ps(v[i], v[i + 4]), norm));
    _mm512_storeu_ps(dst + 64 + 16 * i, _mm512_mul_ps(_mm512_sub_ps(v[i], v[i + 4]), norm));
  }
}

inline float amax_of(const float* p, int n) {
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(p + i)));
  return _mm512_reduce_max_ps(m);
}

// 64 floats → 64 int8 codes at dst (one A-tile row); returns their sum.
inline int32_t quantize64(const float* p, const detail::QuotientCodes512& codes, int8_t* dst) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i sum = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    __m512i v = codes(_mm512_loadu_ps(p + 16 * j));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    sum = _mm512_add_epi32(sum, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * j), _mm512_cvtepi32_epi8(v));
  }
  return _mm512_reduce_add_epi32(sum);
}

struct Isa {
  static void fwht_block(const float* src, float* dst) { sg::fwht_block(src, dst); }
  static float amax_of(const float* p, int n) { return sg::amax_of(p, n); }
  static int32_t quantize64(const float* p, float scale, int8_t* dst) {
    return sg::quantize64(p, detail::QuotientCodes512(scale), dst);
  }
};

void quantize_row(const float* x, int k, int hadamard, int row, QAct* out) {
  detail::quantize_row_with<Isa>(x, k, hadamard, row, out);
}

}  // namespace

void quantize_activations_avx512(const float* x, int ldx, int m, int k, int hadamard, QAct* out, ThreadPool* pool) {
  detail::quantize_rows(x, ldx, nullptr, m, k, hadamard, out, pool, quantize_row);
}

void quantize_activations_from_avx512(const RowSource& src, int m, int k, int hadamard, QAct* out,
                                      ThreadPool* pool) {
  detail::quantize_rows(nullptr, 0, &src, m, k, hadamard, out, pool, quantize_row);
}

}  // namespace sg
