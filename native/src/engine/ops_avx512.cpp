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
#include "exp_avx512.h"
#include "ops.h"

namespace sg::ops {

namespace {

// 16 cached K/V elements of E bytes at byte address p, element i on: int8 codes as f32 (E = 1; the caller applies
// the row scale), f16 (2) or f32 (4).
template <int E>
inline __m512 load_kv16(const uint8_t* p, int i) {
  if constexpr (E == 4) return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i);
  else if constexpr (E == 2) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
  else
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
}

template <int NH, int E>
void qk_scores(const float* q, int q_stride, int hd, const AttnCache& c, const Run* runs, int n_runs, int span,
               float* s) {
  for (int ri = 0; ri < n_runs; ++ri) {
    const uint8_t* k = c.k + int64_t(runs[ri].row) * c.row_bytes + c.head_off;
    const float* ks = E != 1 ? nullptr : c.ks + runs[ri].row;
    float* out = s + runs[ri].off;
    for (int j = 0; j < runs[ri].len; ++j, k += c.row_bytes) {
      __m512 acc[NH];
      for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
      for (int d = 0; d < hd; d += 16) {
        const __m512 kf = load_kv16<E>(k, d);
        for (int h = 0; h < NH; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * q_stride + d), kf, acc[h]);
      }
      for (int h = 0; h < NH; ++h) {
        const float dot = _mm512_reduce_add_ps(acc[h]);
        out[h * span + j] = E != 1 ? dot : dot * ks[j];
      }
    }
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
