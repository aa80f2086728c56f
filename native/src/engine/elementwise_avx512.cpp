// AVX-512 (zmm) twins of the element-wise kernels of ops_avx2.cpp (ops.h: Elementwise). Compiled with
// -mavx512f -mavx512bw -mavx512vl -mfma -mf16c, like ops_avx512.cpp; the Model picks them on the VNNI and AMX
// backends (their CPUs have AVX-512), FGM_BACKEND=avx2 keeps the ymm ones.
//
// Every kernel here gives the ymm kernel's bits (tests/test_engine.py test_zmm_elementwise_is_bit_identical): each
// output element is the same sequence of IEEE operations, 16 lanes at a time instead of 8.
//  * Reductions (the RMS norm's sum of squares) keep the ymm association: the ymm loop keeps two 8-lane
//    accumulators fed by alternate 8-float blocks, which are exactly the halves of one 16-lane accumulator; the
//    halves are then added and reduced by the same ymm tree, and the tails follow the ymm tails.
//  * exp/tanh/GELU are the ymm polynomials on zmm (same constants, same FMA chain, same rounding of n).
//  * Element-wise tails shorter than a register go through masked zmm operations, which round as the ymm code's
//    vector body and scalar tail do; GELU and softcap hand their last n % 8 elements to the ymm functions, whose
//    scalar tails are written in another association.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "exp_avx512.h"
#include "ops.h"

namespace sg::ops {

namespace {

inline __mmask16 tail_mask(int n) { return __mmask16((1u << n) - 1); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 upper256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// As gelu8: x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
inline __m512 gelu16(__m512 x) {
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
  const __m512 e = exp16(_mm512_mul_ps(u, _mm512_set1_ps(-2.0f)));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// As tanh8: sign(t) (1 - e^-2|t|) / (1 + e^-2|t|).
inline __m512 tanh16(__m512 t) {
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32(int(0x80000000u)));
  const __m512 a = _mm512_abs_ps(t);
  const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
  const __m512 r = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}

// Applies f(i, mask) to x[0..n) in 16-lane steps, the last one masked (n % 16 lanes).
template <class F>
inline void for_lanes(int n, F&& f) {
  int i = 0;
  for (; i + 16 <= n; i += 16) f(i, __mmask16(0xFFFF));
  if (i < n) f(i, tail_mask(n - i));
}

// sum_squares of ops_avx2.cpp in its association (see the top of this file).
float sum_squares(const float* x, int n) {
  __m512 a = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    a = _mm512_fmadd_ps(v, v, a);
  }
  __m256 a0 = _mm512_castps512_ps256(a);
  const __m256 a1 = upper256(a);
  if (i + 8 <= n) {
    const __m256 v = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(v, v, a0);
    i += 8;
  }
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

float rms_inv(const float* x, int n, float eps) {
  return float(1.0 / std::sqrt(double(sum_squares(x, n)) / n + double(eps)));
}

void rmsnorm_z(const float* x, const float* w, float* y, int n, float eps) {
  const __m512 inv = _mm512_set1_ps(rms_inv(x, n, eps));
  if (w)
    for_lanes(n, [&](int i, __mmask16 k) {
      _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv),
                                                    _mm512_maskz_loadu_ps(k, w + i)));
    });
  else
    for_lanes(n, [&](int i, __mmask16 k) {
      _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    });
}

void add_rmsnorm_z(float* h, const float* a, const float* w, int n, float eps) {
  const __m512 inv = _mm512_set1_ps(rms_inv(a, n, eps));
  for_lanes(n, [&](int i, __mmask16 k) {
    _mm512_mask_storeu_ps(h + i, k, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, a + i), inv),
                                                    _mm512_maskz_loadu_ps(k, w + i), _mm512_maskz_loadu_ps(k, h + i)));
  });
}

void scale_z(float* x, int n, float s) {
  const __m512 s16 = _mm512_set1_ps(s);
  for_lanes(n, [&](int i, __mmask16 k) {
    _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), s16));
  });
}

// GELU and tanh have scalar tails in ops_avx2.cpp written in another association: the last n % 8 elements go to the
// ymm entry points, which run exactly those.
void gelu_mul_z(float* g, const float* u, int n) {
  const int n8 = n & ~7;
  for_lanes(n8, [&](int i, __mmask16 k) {
    _mm512_mask_storeu_ps(g + i, k, _mm512_mul_ps(gelu16(_mm512_maskz_loadu_ps(k, g + i)), _mm512_maskz_loadu_ps(k, u + i)));
  });
  if (n8 < n) gelu_mul(g + n8, u + n8, n - n8);
}

void softcap_z(float* x, int n, float cap) {
  const __m512 c16 = _mm512_set1_ps(cap), ic16 = _mm512_set1_ps(1.0f / cap);
  const int n8 = n & ~7;
  for_lanes(n8, [&](int i, __mmask16 k) {
    _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(c16, tanh16(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), ic16))));
  });
  if (n8 < n) softcap(x + n8, n - n8, cap);
}

void rope_z(float* x, int half, const float* cos, const float* sin) {
  float* y = x + half;
  for_lanes(half, [&](int d, __mmask16 k) {
    const __m512 a = _mm512_maskz_loadu_ps(k, x + d), b = _mm512_maskz_loadu_ps(k, y + d);
    const __m512 c = _mm512_maskz_loadu_ps(k, cos + d), s = _mm512_maskz_loadu_ps(k, sin + d);
    _mm512_mask_storeu_ps(x + d, k, _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, s)));
    _mm512_mask_storeu_ps(y + d, k, _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, s)));
  });
}

void quantize_row_i8_z(const float* x, int n, int8_t* q, float* scale_out) {
  __m512 mv = _mm512_setzero_ps();
  for_lanes(n, [&](int i, __mmask16 k) { mv = _mm512_max_ps(mv, _mm512_abs_ps(_mm512_maskz_loadu_ps(k, x + i))); });
  const float amax = _mm512_reduce_max_ps(mv);
  if (!(amax > 0)) {
    std::memset(q, 0, n);
    *scale_out = 0.0f;
    return;
  }
  const float s = amax / 127.0f;
  *scale_out = s;
  const __m512 inv = _mm512_set1_ps(1.0f / s);
  const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
  for_lanes(n, [&](int i, __mmask16 k) {
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv), nlim), lim);
    _mm_mask_storeu_epi8(q + i, k, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));  // round half to even
  });
}

void store_row_f16_z(const float* x, int n, uint16_t* out) {
  for_lanes(n, [&](int i, __mmask16 k) {
    _mm256_mask_storeu_epi16(out + i, k, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, x + i), _MM_FROUND_TO_NEAREST_INT));
  });
}

// One butterfly stage inside each zmm (strides 1..8): lanes with the stride bit clear get x[i] + x[i^s], the others
// x[i^s] - x[i], as the scalar v[j] = a + c, v[j + h] = a - c of fwht_blocks in ops_avx2.cpp.
inline __m512 in_lane_stage(__m512 x, __m512 swapped, __mmask16 upper) {
  return _mm512_mask_sub_ps(_mm512_add_ps(x, swapped), upper, swapped, x);
}

// fwht_blocks on blocks of 16 * NV floats held in NV registers: strides 1, 2, 4, 8 in each register, then 16, 32,
// ... between registers, then the multiply by 1/sqrt(block) — the scalar code's order, so the same bits.
template <int NV>
void fwht_regs(float* x, int n, float norm) {
  const __m512 nv = _mm512_set1_ps(norm);
  for (int b = 0; b < n; b += 16 * NV) {
    __m512 v[NV];
    for (int i = 0; i < NV; ++i) {
      __m512 r = _mm512_loadu_ps(x + b + 16 * i);
      r = in_lane_stage(r, _mm512_permute_ps(r, 0xB1), 0xAAAA);
      r = in_lane_stage(r, _mm512_permute_ps(r, 0x4E), 0xCCCC);
      r = in_lane_stage(r, _mm512_shuffle_f32x4(r, r, 0xB1), 0xF0F0);
      v[i] = in_lane_stage(r, _mm512_shuffle_f32x4(r, r, 0x4E), 0xFF00);
    }
    for (int s = 1; s < NV; s <<= 1)
      for (int i = 0; i < NV; ++i)
        if (!(i & s)) {
          const __m512 a = v[i], c = v[i + s];
          v[i] = _mm512_add_ps(a, c);
          v[i + s] = _mm512_sub_ps(a, c);
        }
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(x + b + 16 * i, _mm512_mul_ps(v[i], nv));
  }
}

void fwht_blocks_z(float* x, int n, int block) {
  const float norm = float(1.0 / std::sqrt(double(block)));
  switch (block) {
    case 16: return fwht_regs<1>(x, n, norm);
    case 32: return fwht_regs<2>(x, n, norm);
    case 64: return fwht_regs<4>(x, n, norm);
    case 128: return fwht_regs<8>(x, n, norm);
    default: return fwht_blocks(x, n, block);  // 1, 8 or above 128: the ymm file's loop
  }
}

void head_norm_rope_z(float* x, const float* w, int hd, const float* cs, int rot, float eps) {
  rmsnorm_z(x, w, x, hd, eps);
  rope_z(x, hd / 2, cs, cs + hd / 2);
  fwht_blocks_z(x, hd, rot);
}

void ple_mix_z(float* p, const float* g, const float* w, int n, float proj_scale, float in_scale, float eps) {
  scale_z(p, n, proj_scale);
  rmsnorm_z(p, w, p, n, eps);
  const __m512 s16 = _mm512_set1_ps(in_scale);
  for_lanes(n, [&](int i, __mmask16 k) {
    _mm512_mask_storeu_ps(p + i, k, _mm512_mul_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(k, p + i),
                                                                _mm512_maskz_loadu_ps(k, g + i)), s16));
  });
}

}  // namespace

const Elementwise& elementwise_avx512() {
  static const Elementwise e{rmsnorm_z,        add_rmsnorm_z,   scale_z,       gelu_mul_z, softcap_z,
                             quantize_row_i8_z, store_row_f16_z, fwht_blocks_z, head_norm_rope_z, ple_mix_z};
  return e;
}

}  // namespace sg::ops
