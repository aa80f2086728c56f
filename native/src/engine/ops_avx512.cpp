// AVX-512 (zmm) twins of ops_avx2.cpp's attention (see ops.h): the same algorithm on 16 lanes, so each K/V element
// costs half the conversions and FMAs. Compiled with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c; the Model calls
// it only on the VNNI and AMX backends (their CPUs have AVX-512), FGM_BACKEND=avx2 keeps the ymm code.
//
// Not bit-identical to the ymm path: a dot product sums its 16-lane partial products in another order, and the
// exponential is the same polynomial evaluated on zmm. The tolerance (tests/test_engine.py
// test_avx512_attention_matches_avx2) is that of f32 reassociation: relative 1e-5 on the attention output.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "attend_common.h"
#include "ops.h"

namespace sg::ops {

namespace {

// e^x as exp8 in ops_avx2.cpp: x = n ln2 + r, degree-7 Taylor polynomial of e^r, 2^n in the exponent field.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 16 cached K/V elements of E bytes at byte address p, element i on: int8 codes as f32 (E = 1; the caller applies
// the row scale), f16 (2) or f32 (4).
template <int E>
inline __m512 load_kv16(const uint8_t* p, int i) {
  if constexpr (E == 4) return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i);
  else if constexpr (E == 2) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
  else
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
}

// The sums of the 16 lanes of a0..a3, as the 4 lanes of the result (lane i: a_i). Transposes while it adds: 13
// shuffles and adds for four dot products, where _mm512_reduce_add_ps takes ~8 dependent steps for each one.
inline __m128i hsum4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  // Per 128-bit lane: [a0, a1, a0, a1] partials, then [a0, a1, a2, a3].
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d01 = _mm512_castps_pd(s01), d23 = _mm512_castps_pd(s23);
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of HB heads (q rows q_stride apart) against P consecutive cache rows (P = 4, or 1 for a run's last
// positions) from k on, f16 or f32 elements: each K vector is converted once for the HB heads, and the HB x P dot
// products are summed four positions at a time (hsum4).
template <int HB, int P, int E>
inline void qk_float_group(const float* q, int q_stride, int hd, const uint8_t* k, int row_bytes, float* out,
                           int span) {
  __m512 acc[HB][P];
  for (int h = 0; h < HB; ++h)
    for (int p = 0; p < P; ++p) acc[h][p] = _mm512_setzero_ps();
  for (int d = 0; d < hd; d += 16) {
    __m512 kf[P];
    for (int p = 0; p < P; ++p) kf[p] = load_kv16<E>(k + int64_t(p) * row_bytes, d);
    for (int h = 0; h < HB; ++h) {
      const __m512 qv = _mm512_loadu_ps(q + h * q_stride + d);
      for (int p = 0; p < P; ++p) acc[h][p] = _mm512_fmadd_ps(qv, kf[p], acc[h][p]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    if constexpr (P == 4) _mm_storeu_ps(out + h * span, hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
    else out[h * span] = _mm512_reduce_add_ps(acc[h][0]);
  }
}

template <int NH, int E>
void qk_scores_float(const float* q, int q_stride, int hd, const AttnCache& c, const Run* runs, int n_runs,
                     int span, float* s) {
  constexpr int HB = NH < 4 ? NH : 4;  // heads per pass: HB x 4 accumulators, 4 K vectors, one q vector
  for (int ri = 0; ri < n_runs; ++ri) {
    const uint8_t* k = c.k + int64_t(runs[ri].row) * c.row_bytes + c.head_off;
    float* out = s + runs[ri].off;
    const int len = runs[ri].len;
    for (int h0 = 0; h0 < NH; h0 += HB) {
      const float* qh = q + h0 * q_stride;
      float* oh = out + h0 * span;
      int j = 0;
      for (; j + 4 <= len; j += 4)
        qk_float_group<HB, 4, E>(qh, q_stride, hd, k + int64_t(j) * c.row_bytes, c.row_bytes, oh + j, span);
      for (; j < len; ++j)
        qk_float_group<HB, 1, E>(qh, q_stride, hd, k + int64_t(j) * c.row_bytes, c.row_bytes, oh + j, span);
    }
  }
}

// The largest head_dim the int8 Q·K path takes (its quantised queries live on the stack); longer heads convert.
constexpr int kQ8MaxDim = 512;

// Q·K on the int8 cache in int8 (vpdpbusd, 64 products an instruction), as llama.cpp does for a quantised K cache:
// each query head is quantised to int8 codes with one scale (its largest |q| / 127), K codes become unsigned by
// k + 128 (a XOR of the sign bit), and sum((k + 128) q8) - 128 sum(q8) is the exact integer dot of the codes. The
// score is that times the head's q scale and the row's K scale. The error against the f32 dot is the queries'
// rounding alone (the keys are codes already): at most hd/2 * qscale * max|k code| * kscale, and in practice (random
// rounding signs) ~sqrt(hd) times smaller.
template <int HB, int P>
inline void qk_int8_group(const int8_t* q8, int hd, const uint8_t* k, int row_bytes, const int32_t* qsum128,
                          const float* qscale, const float* ks, float* out, int span) {
  __m512i acc[HB][P];
  for (int h = 0; h < HB; ++h)
    for (int p = 0; p < P; ++p) acc[h][p] = _mm512_setzero_si512();
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  for (int d = 0; d < hd; d += 64) {
    __m512i ku[P];
    for (int p = 0; p < P; ++p)
      ku[p] = _mm512_xor_si512(_mm512_loadu_si512(k + int64_t(p) * row_bytes + d), sign);
    for (int h = 0; h < HB; ++h) {
      const __m512i qv = _mm512_loadu_si512(q8 + h * hd + d);
      for (int p = 0; p < P; ++p) acc[h][p] = _mm512_dpbusd_epi32(acc[h][p], ku[p], qv);
    }
  }
  for (int h = 0; h < HB; ++h) {
    if constexpr (P == 4) {
      const __m128i dot = _mm_sub_epi32(hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), _mm_set1_epi32(qsum128[h]));
      const __m128 sc = _mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_set1_ps(qscale[h]));
      _mm_storeu_ps(out + h * span, _mm_mul_ps(sc, _mm_loadu_ps(ks)));
    } else {
      out[h * span] = float(_mm512_reduce_add_epi32(acc[h][0]) - qsum128[h]) * qscale[h] * ks[0];
    }
  }
}

template <int NH>
void qk_scores_int8(const float* q, int q_stride, int hd, const AttnCache& c, const Run* runs, int n_runs, int span,
                    float* s) {
  alignas(64) int8_t q8[NH * kQ8MaxDim];
  int32_t qsum128[NH];
  float qscale[NH];
  for (int h = 0; h < NH; ++h) {
    const float* qh = q + h * q_stride;
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qh + d)));
    const float amax = _mm512_reduce_max_ps(mx);
    qscale[h] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int d = 0; d < hd; d += 16) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qh + d), inv));  // round to nearest
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + h * hd + d), _mm512_cvtsepi32_epi8(qi));
    }
    qsum128[h] = 128 * _mm512_reduce_add_epi32(sum);
  }
  constexpr int HB = NH < 4 ? NH : 4;
  for (int ri = 0; ri < n_runs; ++ri) {
    const uint8_t* k = c.k + int64_t(runs[ri].row) * c.row_bytes + c.head_off;
    const float* ks = c.ks + runs[ri].row;
    float* out = s + runs[ri].off;
    const int len = runs[ri].len;
    for (int h0 = 0; h0 < NH; h0 += HB) {
      const int8_t* qh = q8 + h0 * hd;
      float* oh = out + h0 * span;
      int j = 0;
      for (; j + 4 <= len; j += 4)
        qk_int8_group<HB, 4>(qh, hd, k + int64_t(j) * c.row_bytes, c.row_bytes, qsum128 + h0, qscale + h0, ks + j,
                             oh + j, span);
      for (; j < len; ++j)
        qk_int8_group<HB, 1>(qh, hd, k + int64_t(j) * c.row_bytes, c.row_bytes, qsum128 + h0, qscale + h0, ks + j,
                             oh + j, span);
    }
  }
}

template <int NH, int E>
void qk_scores(const float* q, int q_stride, int hd, const AttnCache& c, const Run* runs, int n_runs, int span,
               float* s) {
  if constexpr (E == 1) {
    if (hd % 64 == 0 && hd <= kQ8MaxDim) return qk_scores_int8<NH>(q, q_stride, hd, c, runs, n_runs, span, s);
    // Other head sizes: the codes as f32, times the row scale afterwards.
    qk_scores_float<NH, 1>(q, q_stride, hd, c, runs, n_runs, span, s);
    for (int ri = 0; ri < n_runs; ++ri)
      for (int h = 0; h < NH; ++h)
        for (int i = 0; i < runs[ri].len; ++i) s[h * span + runs[ri].off + i] *= c.ks[runs[ri].row + i];
  } else {
    qk_scores_float<NH, E>(q, q_stride, hd, c, runs, n_runs, span, s);
  }
}

// As pv_accumulate in ops_avx2.cpp, NH x DB zmm accumulators (DB blocks of 16 dims).
template <int NH, int DB, int E>
void pv_accumulate(const float* w, int span, int hd, const AttnCache& c, const Run* runs, int n_runs, float* out,
                   int out_stride) {
  for (int h = 0; h < NH; ++h) std::memset(out + h * out_stride, 0, sizeof(float) * hd);
  const int tile = hd >= 1024 ? 16 : 16384 / hd;
  for (int ri = 0; ri < n_runs; ++ri) {
    for (int t0 = 0; t0 < runs[ri].len; t0 += tile) {
      const int tn = runs[ri].len - t0 < tile ? runs[ri].len - t0 : tile;
      const uint8_t* v0 = c.v + int64_t(runs[ri].row + t0) * c.row_bytes + c.head_off;
      const float* w0 = w + runs[ri].off + t0;
      for (int d = 0; d < hd; d += 16 * DB) {
        __m512 acc[NH][DB];
        for (int h = 0; h < NH; ++h)
          for (int b = 0; b < DB; ++b) acc[h][b] = _mm512_loadu_ps(out + h * out_stride + d + 16 * b);
        const uint8_t* v = v0;
        for (int j = 0; j < tn; ++j, v += c.row_bytes) {
          __m512 vf[DB];
          for (int b = 0; b < DB; ++b) vf[b] = load_kv16<E>(v, d + 16 * b);
          for (int h = 0; h < NH; ++h) {
            const __m512 wj = _mm512_set1_ps(w0[h * span + j]);
            for (int b = 0; b < DB; ++b) acc[h][b] = _mm512_fmadd_ps(wj, vf[b], acc[h][b]);
          }
        }
        for (int h = 0; h < NH; ++h)
          for (int b = 0; b < DB; ++b) _mm512_storeu_ps(out + h * out_stride + d + 16 * b, acc[h][b]);
      }
    }
  }
}

template <int NH, int E>
void attend_block(const float* q, int q_stride, int hd, const AttnCache& c, int lo, int hi, float* out,
                  int out_stride, float* s) {
  const int span = hi - lo + 1;
  Run runs[2];
  const int n_runs = ring_runs(lo, span, c.cap, runs);
  qk_scores<NH, E>(q, q_stride, hd, c, runs, n_runs, span, s);
  for (int h = 0; h < NH; ++h) {
    float* sh = s + h * span;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= span; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sh + j));
    if (j < span) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, __mmask16((1u << (span - j)) - 1), sh + j));
    const float m = _mm512_reduce_max_ps(mv);
    const __m512 m16 = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    for (j = 0; j < span; j += 16) {
      const __mmask16 k = span - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (span - j)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + j), m16));
      _mm512_mask_storeu_ps(sh + j, k, e);
      sv = _mm512_mask_add_ps(sv, k, sv, e);
    }
    // Fold the normaliser and each position's V scale into the weights.
    fold_weights<E>(sh, c, runs, n_runs, 1.0f / _mm512_reduce_add_ps(sv));
  }
  if constexpr (NH <= 4) {
    if (hd % 64 == 0) return pv_accumulate<NH, 4, E>(s, span, hd, c, runs, n_runs, out, out_stride);
  }
  if (hd % 32 == 0) return pv_accumulate<NH, 2, E>(s, span, hd, c, runs, n_runs, out, out_stride);
  pv_accumulate<NH, 1, E>(s, span, hd, c, runs, n_runs, out, out_stride);
}


template <int NH, int E>
struct ZmmBlock {
  static void run(const float* q, int q_stride, int hd, const AttnCache& c, int lo, int hi, float* out,
                  int out_stride, float* s) {
    attend_block<NH, E>(q, q_stride, hd, c, lo, hi, out, out_stride, s);
  }
};

}  // namespace

void attend_avx512(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi, float* out,
                   int out_stride, float* scratch) {
  if (hd % 16) return attend(q, q_stride, nq, hd, c, lo, hi, out, out_stride, scratch);  // zmm reads 16 dims
  attend_in_blocks<ZmmBlock>(q, q_stride, nq, hd, c, lo, hi, out, out_stride, scratch);
}

}  // namespace sg::ops
