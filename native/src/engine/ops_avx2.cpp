// AVX2 + FMA + F16C kernels (see ops.h). Only internal-linkage helpers and the ops:: entry points live here.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attend_common.h"
#include "ops.h"
#include "ymm_common.h"

namespace sg::ops {

namespace {

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the sigmoid form has no
// cancellation for negative x.
inline __m256 gelu8(__m256 x) {
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
  const __m256 e = exp8(_mm256_mul_ps(u, _mm256_set1_ps(-2.0f)));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline float gelu1(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + exp1(-2.0f * u));
}

// tanh(t) = sign(t) (1 - e^-2|t|) / (1 + e^-2|t|)
inline __m256 tanh8(__m256 t) {
  const __m256 sign = _mm256_and_ps(t, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t);
  const __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
  const __m256 r = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_or_ps(r, sign);
}

inline float tanh1(float t) {
  alignas(32) float b[8];
  _mm256_store_ps(b, tanh8(_mm256_set1_ps(t)));
  return b[0];
}

float sum_squares(const float* x, int n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

float rms_inv(const float* x, int n, float eps) {
  return float(1.0 / std::sqrt(double(sum_squares(x, n)) / n + double(eps)));
}

// Scores of NH heads (q rows q_stride apart) against J consecutive cache rows (row_bytes apart) from k on:
// out[h * span + j] = q_h . k_j (times kscale_j for int8). Each score sums its dims in the same order whatever J and
// the head blocks are, so they change the speed and not the bits. pf: PFS lines an 8-dim step, returned for the next
// head block.
template <int NH, int J, int E, int PFS = 0>
inline LinePrefetch qk_positions(const float* q, int q_stride, int hd, const uint8_t* k, int row_bytes,
                                 const float* ks, int span, float* out, LinePrefetch pf = {}) {
  __m256 acc[J][NH];
  for (int jj = 0; jj < J; ++jj)
    for (int h = 0; h < NH; ++h) acc[jj][h] = _mm256_setzero_ps();
  for (int d = 0; d < hd; d += 8) {
    for (int i = 0; i < PFS; ++i) pf.step();
    __m256 kf[J];
    for (int jj = 0; jj < J; ++jj) kf[jj] = load_kv8<E>(k + int64_t(jj) * row_bytes, d);
    for (int h = 0; h < NH; ++h) {
      // One load of q for the J positions: GCC would fold it into each FMA as a memory operand (J loads, and the
      // loads, not the FMAs, then bound the loop) unless the empty asm pins it in a register.
      __m256 qv = _mm256_loadu_ps(q + h * q_stride + d);
      if constexpr (J > 1) asm("" : "+x"(qv));
      for (int jj = 0; jj < J; ++jj) acc[jj][h] = _mm256_fmadd_ps(qv, kf[jj], acc[jj][h]);
    }
  }
  for (int jj = 0; jj < J; ++jj)
    for (int h = 0; h < NH; ++h) out[h * span + jj] = E != 1 ? hsum(acc[jj][h]) : hsum(acc[jj][h]) * ks[jj];
  return pf;
}

// Scores of NH heads (q rows q_stride apart): s[h * span + j] = q_h . k_j (times kscale_j for int8). Heads go in
// blocks of up to 4 against 2 positions at a time (4 against 1 head or 2): an FMA takes 4 cycles and Zen 3 and Intel
// cores start two a cycle, so fewer than 8 independent sums leave the FMA pipes idle (4 heads on one position: half
// the rate). Each group of positions is read from memory once for all head blocks; the rows prefetch_ahead on are
// prefetched one line a step (a decode batch streams every row's slot from DRAM, and the hardware prefetchers stop at
// each 4 KiB page).
template <int NH, int E>
void qk_scores(const float* q, int q_stride, int hd, const AttnCache& c, const Run* runs, int n_runs, int span,
               float* s) {
  constexpr int HB = NH < 4 ? NH : 4, J = HB <= 2 ? 4 : 2, blocks = (NH + HB - 1) / HB;
  // The J rows' J * hd * E / 64 lines over blocks * hd / 8 steps.
  constexpr int PFS = (J * E + 8 * blocks - 1) / (8 * blocks);
  const int ahead = prefetch_ahead(hd * E);
  for (int ri = 0; ri < n_runs; ++ri) {
    const uint8_t* k = c.k + int64_t(runs[ri].row) * c.row_bytes + c.head_off;
    const float* ks = E != 1 ? nullptr : c.ks + runs[ri].row;
    float* out = s + runs[ri].off;
    const int len = runs[ri].len;
    int j = 0;
    for (; j + J <= len; j += J) {
      LinePrefetch pf = head_rows(c.k, c, runs[ri].row + j + ahead, std::min(J, len - j - ahead), hd * E);
      for_head_blocks<NH, HB>([&](auto hb, int h0) {
        pf = qk_positions<decltype(hb)::value, J, E, PFS>(q + h0 * q_stride, q_stride, hd, k + int64_t(j) * c.row_bytes,
                                                          c.row_bytes, ks ? ks + j : nullptr, span, out + h0 * span + j,
                                                          pf);
      });
    }
    for (; j < len; ++j)
      for_head_blocks<NH, HB>([&](auto hb, int h0) {
        qk_positions<decltype(hb)::value, 1, E>(q + h0 * q_stride, q_stride, hd, k + int64_t(j) * c.row_bytes,
                                                c.row_bytes, ks ? ks + j : nullptr, span, out + h0 * span + j);
      });
  }
}

// One tile of tn positions (V rows row_bytes apart from v0) into HB heads' outputs (weights w0[h * span + j]): HB x DB
// accumulators a pass over DB blocks of 8 dims, loaded from and stored back to out. pf: one line a position step,
// returned for the next head block (a copy, not a reference: the compiler would reload it after every store of a
// vector, whose type may alias anything).
template <int HB, int DB, int E>
inline LinePrefetch pv_tile(const float* w0, int span, int hd, const uint8_t* v0, int row_bytes, int tn, float* out,
                            int out_stride, LinePrefetch pf) {
  for (int d = 0; d < hd; d += 8 * DB) {
    __m256 acc[HB][DB];
    for (int h = 0; h < HB; ++h)
      for (int b = 0; b < DB; ++b) acc[h][b] = _mm256_loadu_ps(out + h * out_stride + d + 8 * b);
    const uint8_t* v = v0 + E * d;
    for (int j = 0; j < tn; ++j, v += row_bytes) {
      pf.step();
      __m256 vf[DB];
      for (int b = 0; b < DB; ++b) vf[b] = load_kv8<E>(v, 8 * b);
      for (int h = 0; h < HB; ++h) {
        const __m256 wj = _mm256_broadcast_ss(w0 + h * span + j);
        for (int b = 0; b < DB; ++b) acc[h][b] = _mm256_fmadd_ps(wj, vf[b], acc[h][b]);
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int b = 0; b < DB; ++b) _mm256_storeu_ps(out + h * out_stride + d + 8 * b, acc[h][b]);
  }
  return pf;
}

// out_h[d] = sum_j w[h * span + j] * vcode_j[d] (the weights already carry the softmax normaliser and the V scale).
// Positions go in tiles of ~16 KiB of V that stay in L1 while every head block sweeps all dims; a pass keeps HB x DB
// accumulators (DB blocks of 8 dims; heads in blocks of up to 4, so that DB >= 2 and each broadcast weight feeds two
// FMAs) with enough independent FMA chains in flight. Each output element sums its positions in order whatever the
// tiles and blocks are (the partial sums go through out exactly), so they change the speed and not the bits. The next
// tile's V rows are prefetched one line a step.
template <int NH, int E>
void pv_accumulate(const float* w, int span, int hd, const AttnCache& c, const Run* runs, int n_runs, float* out,
                   int out_stride) {
  for (int h = 0; h < NH; ++h) std::memset(out + h * out_stride, 0, sizeof(float) * hd);
  const int tile = std::max(16, 16384 / (hd * E));
  for (int ri = 0; ri < n_runs; ++ri) {
    for (int t0 = 0; t0 < runs[ri].len; t0 += tile) {
      const int tn = runs[ri].len - t0 < tile ? runs[ri].len - t0 : tile;
      const uint8_t* v0 = c.v + int64_t(runs[ri].row + t0) * c.row_bytes + c.head_off;
      const float* w0 = w + runs[ri].off + t0;
      LinePrefetch pf = head_rows(c.v, c, runs[ri].row + t0 + tile, std::min(tile, runs[ri].len - t0 - tile), hd * E);
      for_head_blocks<NH, 4>([&](auto hb, int h0) {
        constexpr int HB = decltype(hb)::value;
        const float* wh = w0 + h0 * span;
        float* oh = out + h0 * out_stride;
        if constexpr (HB <= 2) {
          if (hd % 32 == 0) return void(pf = pv_tile<HB, 4, E>(wh, span, hd, v0, c.row_bytes, tn, oh, out_stride, pf));
        }
        if (hd % 16 == 0) return void(pf = pv_tile<HB, 2, E>(wh, span, hd, v0, c.row_bytes, tn, oh, out_stride, pf));
        pf = pv_tile<HB, 1, E>(wh, span, hd, v0, c.row_bytes, tn, oh, out_stride, pf);
      });
    }
  }
}

template <int NH, int E>
void attend_block(const float* q, int q_stride, int hd, const AttnCache& c, int lo, int hi, float* out,
                  int out_stride, float* s, float* stats) {
  const int span = hi - lo + 1;
  Run runs[2];
  const int n_runs = ring_runs(lo, span, c.cap, runs);
  qk_scores<NH, E>(q, q_stride, hd, c, runs, n_runs, span, s);
  for (int h = 0; h < NH; ++h) {
    float* sh = s + h * span;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= span; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sh + j));
    float m = hmax(mv);
    for (; j < span; ++j) m = sh[j] > m ? sh[j] : m;
    const __m256 m8 = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (j = 0; j + 8 <= span; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), m8));
      _mm256_storeu_ps(sh + j, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; j < span; ++j) sum += (sh[j] = exp1(sh[j] - m));
    if (stats) {
      stats[2 * h] = m;
      stats[2 * h + 1] = sum;
    }
    // Fold the normaliser and each position's V scale into the weights.
    fold_weights<E>(sh, c, runs, n_runs, 1.0f / sum);
  }
  pv_accumulate<NH, E>(s, span, hd, c, runs, n_runs, out, out_stride);
}

// Folds one part's outputs (part, nq heads of hd) with its stats into out, whose parts so far have the running
// stats run (2 floats a head): attend_merge_parts_avx512's arithmetic (ops_avx512.cpp attend_fold_part) in ymm.
inline void fold_part(float* out, int out_stride, float* run, const float* part, const float* stats, int nq, int hd) {
  for (int h = 0; h < nq; ++h) {
    const float m = std::max(run[2 * h], stats[2 * h]);
    const float a = run[2 * h + 1] * std::exp(run[2 * h] - m), b = stats[2 * h + 1] * std::exp(stats[2 * h] - m);
    const float l = a + b;
    const __m256 fa = _mm256_set1_ps(a / l), fb = _mm256_set1_ps(b / l);
    float* o = out + int64_t(h) * out_stride;
    const float* x = part + int64_t(h) * hd;
    int d = 0;
    for (; d + 8 <= hd; d += 8)
      _mm256_storeu_ps(o + d, _mm256_fmadd_ps(fa, _mm256_loadu_ps(o + d), _mm256_mul_ps(fb, _mm256_loadu_ps(x + d))));
    for (; d < hd; ++d) o[d] = std::fma(a / l, o[d], b / l * x[d]);
    run[2 * h] = m;
    run[2 * h + 1] = l;
  }
}

// stats null: the whole span [lo, hi] as its attend_parts() parts folded in order, as the zmm kernel does (scratch:
// a part's scores, then a part's outputs and stats), so single-stream decode can hand the parts to different
// threads (attend_part, attend_merge_parts_ymm) and get this call's bits; else the one part [lo, hi], its stats to
// stats.
template <int NH, int E>
struct YmmBlock {
  static void run(const float* q, int q_stride, int hd, const AttnCache& c, int lo, int hi, float* out,
                  int out_stride, float* s, float* stats) {
    const int span = hi - lo + 1, n = attend_parts(span);
    if (stats || n == 1) return attend_block<NH, E>(q, q_stride, hd, c, lo, hi, out, out_stride, s, stats);
    float run[2 * NH];
    attend_block<NH, E>(q, q_stride, hd, c, lo, attend_part_start(lo, span, 1) - 1, out, out_stride, s, run);
    float* part = s + NH * kAttendPartPositions;
    float* part_stats = part + NH * hd;
    for (int p = 1; p < n; ++p) {
      attend_block<NH, E>(q, q_stride, hd, c, attend_part_start(lo, span, p), attend_part_start(lo, span, p + 1) - 1,
                          part, hd, s, part_stats);
      fold_part(out, out_stride, run, part, part_stats, NH, hd);
    }
  }
};

}  // namespace

void rmsnorm(const float* x, const float* w, float* y, int n, float eps) {
  const __m256 inv = _mm256_set1_ps(rms_inv(x, n, eps));
  int i = 0;
  if (w) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), _mm256_loadu_ps(w + i)));
    for (; i < n; ++i) y[i] = x[i] * _mm256_cvtss_f32(inv) * w[i];
  } else {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; i < n; ++i) y[i] = x[i] * _mm256_cvtss_f32(inv);
  }
}

void add_rmsnorm(float* h, const float* a, const float* w, int n, float eps) {
  const __m256 inv = _mm256_set1_ps(rms_inv(a, n, eps));
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(h + i, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(a + i), inv), _mm256_loadu_ps(w + i),
                                            _mm256_loadu_ps(h + i)));
  for (; i < n; ++i) h[i] += a[i] * _mm256_cvtss_f32(inv) * w[i];
}

void scale(float* x, int n, float s) {
  const __m256 s8 = _mm256_set1_ps(s);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), s8));
  for (; i < n; ++i) x[i] *= s;
}

void gelu_mul(float* g, const float* u, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(g + i, _mm256_mul_ps(gelu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
  for (; i < n; ++i) g[i] = gelu1(g[i]) * u[i];
}

void softcap(float* x, int n, float cap) {
  const __m256 c8 = _mm256_set1_ps(cap), ic8 = _mm256_set1_ps(1.0f / cap);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(c8, tanh8(_mm256_mul_ps(_mm256_loadu_ps(x + i), ic8))));
  for (; i < n; ++i) x[i] = cap * tanh1(x[i] / cap);
}

void rope(float* x, int half, const float* cos, const float* sin) {
  float* y = x + half;
  int d = 0;
  for (; d + 8 <= half; d += 8) {
    const __m256 a = _mm256_loadu_ps(x + d), b = _mm256_loadu_ps(y + d);
    const __m256 c = _mm256_loadu_ps(cos + d), s = _mm256_loadu_ps(sin + d);
    _mm256_storeu_ps(x + d, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
    _mm256_storeu_ps(y + d, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
  }
  for (; d < half; ++d) {
    const float a = x[d], b = y[d];
    x[d] = a * cos[d] - b * sin[d];
    y[d] = b * cos[d] + a * sin[d];
  }
}

void quantize_row_i8(const float* x, int n, int8_t* q, float* scale_out) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mv = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
  float amax = hmax(mv);
  for (; i < n; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
  if (!(amax > 0)) {
    std::memset(q, 0, n);
    *scale_out = 0.0f;
    return;
  }
  const float s = amax / 127.0f;
  *scale_out = s;
  const __m256 inv = _mm256_set1_ps(1.0f / s);
  const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
  for (i = 0; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), inv);
    v = _mm256_min_ps(_mm256_max_ps(v, nlim), lim);
    const __m256i c = _mm256_cvtps_epi32(v);  // round half to even
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w, w));
  }
  for (; i < n; ++i) {
    float v = x[i] * (1.0f / s);
    v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
    q[i] = int8_t(std::nearbyint(v));
  }
}

void store_row_f16(const float* x, int n, uint16_t* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

void gather_q4r(const uint8_t* codes, const uint16_t* scales, int k, float mult, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  for (int b = 0; b < k / 64; ++b) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * b));
    // Two's-complement nibbles: (v ^ 8) - 8. Byte j holds column j (low) and column j + 32 (high).
    const __m256i lo = _mm256_sub_epi8(_mm256_xor_si256(_mm256_and_si256(bytes, low4), eight), eight);
    const __m256i hi =
        _mm256_sub_epi8(_mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4), eight), eight);
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(scales[b]) * mult);
    alignas(32) int8_t c[64];
    _mm256_store_si256(reinterpret_cast<__m256i*>(c), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(c + 32), hi);
    float* o = out + 64 * b;
    for (int j = 0; j < 64; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(load_i8_as_f32(c + j), s));
  }
}

void gather_q8r(const int8_t* codes, float row_scale, int k, float mult, float* out) {
  const __m256 s = _mm256_set1_ps(row_scale * mult);
  int i = 0;
  for (; i + 8 <= k; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(load_i8_as_f32(codes + i), s));
  for (; i < k; ++i) out[i] = codes[i] * row_scale * mult;
}

void gather_q8g(const int8_t* panel, int lane, const void* scales, bool scales_f16, const float* offsets, int n,
                int group, int k, float mult, float* out) {
  // Column-strided reads (one byte per k in a 16-byte panel row): a row of the table is only a few KB.
  for (int g = 0; g < k / group; ++g) {
    const float s = scales_f16 ? _cvtsh_ss(static_cast<const uint16_t*>(scales)[int64_t(g) * n])
                               : static_cast<const float*>(scales)[int64_t(g) * n];
    if (offsets) {
      const float o = offsets[int64_t(g) * n];
      for (int j = g * group; j < (g + 1) * group; ++j) {
        // fl(fl(code · s) + o), the format's value: the empty asm keeps this file's default -ffp-contract=fast from
        // fusing the two into one FMA (the same number whenever code · s is exact, as for every GGUF block type).
        float cs = float(panel[int64_t(j) * 16 + lane]) * s;
        asm("" : "+x"(cs));
        out[j] = (cs + o) * mult;
      }
    } else {
      for (int j = g * group; j < (g + 1) * group; ++j) out[j] = float(panel[int64_t(j) * 16 + lane]) * s * mult;
    }
  }
}

void fwht_blocks(float* x, int n, int block) {
  if (block == 1) return;
  const float norm = float(1.0 / std::sqrt(double(block)));
  for (int b = 0; b < n; b += block) {
    float* v = x + b;
    for (int h = 1; h < block; h <<= 1)
      for (int i = 0; i < block; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float a = v[j], c = v[j + h];
          v[j] = a + c;
          v[j + h] = a - c;
        }
    for (int i = 0; i < block; ++i) v[i] *= norm;
  }
}

int kv_rotation_block(int head_dim) { return std::min(128, head_dim & -head_dim); }

namespace {

void head_norm_rope(float* x, const float* w, int hd, const float* cs, int rot, float eps) {
  rmsnorm(x, w, x, hd, eps);
  rope(x, hd / 2, cs, cs + hd / 2);
  fwht_blocks(x, hd, rot);
}

void ple_mix(float* p, const float* g, const float* w, int n, float proj_scale, float in_scale, float eps) {
  scale(p, n, proj_scale);
  rmsnorm(p, w, p, n, eps);
  const __m256 s8 = _mm256_set1_ps(in_scale);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(p + i, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(g + i)), s8));
  for (; i < n; ++i) p[i] = (p[i] + g[i]) * in_scale;
}

}  // namespace

const Elementwise& elementwise_avx2() {
  static const Elementwise e{rmsnorm,         add_rmsnorm,   scale,          gelu_mul, softcap, quantize_row_i8,
                             store_row_f16,   fwht_blocks,   head_norm_rope, ple_mix};
  return e;
}


void attend(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi, float* out,
            int out_stride, float* scratch) {
  attend_in_blocks<YmmBlock>(q, q_stride, nq, hd, c, lo, hi, out, out_stride, scratch);
}

void attend_part(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi, float* out,
                 int out_stride, float* scratch, float* stats) {
  attend_in_blocks<YmmBlock>(q, q_stride, nq, hd, c, lo, hi, out, out_stride, scratch, stats);
}

void attend_merge_parts_ymm(const float* parts, const float* stats, int n_parts, int nq, int hd, float* out,
                            int out_stride) {
  merge_parts(parts, stats, n_parts, nq, hd, out, out_stride, fold_part);
}

float max_finite(const float* x, int n, bool* all_finite) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(3.4028235e38f);
  __m256 mv = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mv = _mm256_max_ps(mv, v);
    // NaN or +-inf: |v| > FLT_MAX is false for NaN, so test "not <=".
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(v, absmask), big, _CMP_NLE_UQ));
  }
  float m = hmax(mv);
  bool ok = _mm256_movemask_ps(bad) == 0;
  for (; i < n; ++i) {
    ok &= std::isfinite(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  *all_finite = ok;
  return m;
}

void best_k_ids(const float* x, int n, int k, int* out) {
  if (k <= 0) return;
  const auto better = [x](int a, int b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  if (k > n / 8) {  // a large share of the row: the heap would take most values anyway
    thread_local std::vector<int> all;
    all.resize(n);
    for (int i = 0; i < n; ++i) all[i] = i;
    std::partial_sort(all.begin(), all.begin() + k, all.end(), better);
    std::copy(all.begin(), all.begin() + k, out);
    return;
  }
  // out[0..k) as a heap whose front is the worst id kept (the sort order's last); a later id enters only with a
  // value above the front's (equal values keep the lower, earlier id), so the vector pass lets through > only: with
  // >=, a row whose k-th best value repeats (min_p or min_tokens leave most of a row at the lowest float) sent every
  // id through the scalar offer.
  for (int i = 0; i < k; ++i) out[i] = i;
  std::make_heap(out, out + k, better);
  auto offer = [&](int i) {
    if (!better(i, out[0])) return;
    std::pop_heap(out, out + k, better);
    out[k - 1] = i;
    std::push_heap(out, out + k, better);
  };
  int i = k;
  __m256 thr = _mm256_set1_ps(x[out[0]]);
  for (; i + 8 <= n; i += 8) {
    unsigned bits = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), thr, _CMP_GT_OQ)));
    if (!bits) continue;
    for (; bits; bits &= bits - 1) offer(i + __builtin_ctz(bits));
    thr = _mm256_set1_ps(x[out[0]]);
  }
  for (; i < n; ++i) offer(i);
  std::sort_heap(out, out + k, better);  // ascending in the sort order: best first
}

int exclude_below(float* x, int n, float thr, float out) {
  const __m256 t8 = _mm256_set1_ps(thr), o8 = _mm256_set1_ps(out);
  int set = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 m = _mm256_andnot_ps(_mm256_cmp_ps(v, o8, _CMP_EQ_OQ), _mm256_cmp_ps(v, t8, _CMP_LT_OQ));
    set += __builtin_popcount(unsigned(_mm256_movemask_ps(m)));
    _mm256_storeu_ps(x + i, _mm256_blendv_ps(v, o8, m));
  }
  for (; i < n; ++i)
    if (x[i] < thr && x[i] != out) x[i] = out, ++set;
  return set;
}

void ids_not_equal(const float* x, int n, float out, std::vector<int>& ids) {
  const __m256 o8 = _mm256_set1_ps(out);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (unsigned bits = ~unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), o8, _CMP_EQ_OQ))) & 0xffu;
         bits; bits &= bits - 1)
      ids.push_back(i + __builtin_ctz(bits));
  for (; i < n; ++i)
    if (x[i] != out) ids.push_back(i);
}

namespace {

// The block's exponentials (x[b0 .. b0 + kExpBlock) ∩ [0, n)) as floats in e[]: exp8's values (exp1 is exp8 of a
// broadcast, so a row's tail gets the same ones). exp_scan sums them and exp_find walks them, from the same floats.
int exp_block(const float* x, int n, int b0, float max, float inv_t, float* e) {
  const int end = std::min(n, b0 + kExpBlock);
  const __m256 m8 = _mm256_set1_ps(max), t8 = _mm256_set1_ps(inv_t);
  int i = b0;
  for (; i + 8 <= end; i += 8)
    _mm256_storeu_ps(e + i - b0, exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m8), t8)));
  for (; i < end; ++i) e[i - b0] = exp1((x[i] - max) * inv_t);
  return end - b0;
}

}  // namespace

double exp_scan(const float* x, int n, float max, float inv_t, double* block_totals) {
  double total = 0;
  for (int b0 = 0; b0 < n; b0 += kExpBlock) {
    // Four double chains per block (a vector's low and high halves, two vectors a round): one chain in id order
    // was bound by its additions' latency (388 us for 262144 ids on Zen 3, against 166 for these).
    alignas(32) float e[kExpBlock];
    const int cnt = exp_block(x, n, b0, max, inv_t, e), whole = cnt / 16 * 16;
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < whole; i += 16) {
      const __m256 v = _mm256_load_ps(e + i), w = _mm256_load_ps(e + i + 8);
      a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
      a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(w)));
      a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
    }
    const __m256d s4 = _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3));
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    double t = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    for (int i = whole; i < cnt; ++i) t += double(e[i]);  // a row's last, partial block
    if (block_totals) block_totals[b0 / kExpBlock] = t;
    total += t;
  }
  return total;
}

int exp_find(const float* x, int n, float max, float inv_t, const double* block_totals, double target) {
  double total = 0;
  for (int b = 0; b * kExpBlock < n; ++b) {
    if (!(total + block_totals[b] > target)) {
      total += block_totals[b];
      continue;
    }
    float e[kExpBlock];
    const int cnt = exp_block(x, n, b * kExpBlock, max, inv_t, e);
    for (int j = 0; j < cnt; ++j)
      if ((total += double(e[j])) > target) return b * kExpBlock + j;
    return b * kExpBlock + cnt - 1;  // round-off: the block's end exceeded the draw, its own sum did not
  }
  return n - 1;  // round-off can leave the draw above every total
}

}  // namespace sg::ops
