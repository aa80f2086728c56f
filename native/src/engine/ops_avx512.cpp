// AVX-512 (zmm) attention for one query row (see ops.h), beside ops_avx2.cpp's ymm reference. Compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma -mf16c; the Model calls it only on the VNNI and AMX backends
// (their CPUs have AVX-512 VNNI), FGM_BACKEND=avx2 keeps the ymm code. What differs from the ymm algorithm:
//  * Q·K takes four cache rows at a time for up to four heads and sums the 16 lanes of the 16 dot products with one
//    transposing reduction (hsum4) instead of a horizontal reduction per dot product;
//  * on the int8 cache (head_dim a multiple of 32, at most 512) Q·K and P·V run in int16 (vpdpwssd): each query
//    head is quantised to int16 with one scale (qk_int8_group), and the weights of a tile of positions likewise
//    (pv_int8);
//  * the K and V rows are prefetched in software ~8 KiB ahead (a decode batch streams every row's slot from DRAM),
//    a few lines per step of the arithmetic (line_prefetch.h) rather than in bursts.
// So the result is not bit-identical to the ymm path. f16 and f32 K/V: f32 reassociation only (relative ~1e-6).
// int8 K/V: the queries' int16 rounding moves a score by at most max|q| / 32766 * sum_d |k_d| (k = code * scale),
// typically by max|q| / (16383 sqrt(12)) * |k| (independent roundings); the weights' int16 rounding moves each
// weight by at most 2^-16 of its tile's largest. tests/test_engine.py test_attend_row_zmm_matches_ymm states the
// output tolerance that follows, test_avx512_attention_matches_avx2 checks the logits of whole runs.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "attend_common.h"
#include "exp_avx512.h"
#include "line_prefetch.h"
#include "ops.h"

namespace sg::ops {

namespace {

// acc + the products of the int16 pairs of a and b (vpdpwssd), written as asm: GCC 12 copies the accumulator through
// another register around each of its intrinsics (two moves an instruction, and spills once the accumulators fill
// the register file), which costs more than the products.
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
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
// pf: PFS lines a 16-dim step (as qk_int8_group's), returned for the next head block.
template <int HB, int P, int E, int PFS = 0>
inline LinePrefetch qk_float_group(const float* q, int q_stride, int hd, const uint8_t* k, int row_bytes, float* out,
                                   int span, LinePrefetch pf = {}) {
  __m512 acc[HB][P];
  for (int h = 0; h < HB; ++h)
    for (int p = 0; p < P; ++p) acc[h][p] = _mm512_setzero_ps();
  for (int d = 0; d < hd; d += 16) {
    for (int i = 0; i < PFS; ++i) pf.step();
    __m512 kf[P];
    for (int p = 0; p < P; ++p) kf[p] = load_kv16<E>(k + int64_t(p) * row_bytes, d);
    for (int h = 0; h < HB; ++h) {
      const __m512 qv = _mm512_loadu_ps(q + h * q_stride + d);
      for (int p = 0; p < P; ++p) acc[h][p] = _mm512_fmadd_ps(qv, kf[p], acc[h][p]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    if constexpr (P == 4) _mm_storeu_ps(out + h * span, hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
    // hsum4's order, so a position's score does not depend on whether it falls in a group of 4 (the ring's runs)
    else out[h * span] = _mm_cvtss_f32(hsum4(acc[h][0], acc[h][0], acc[h][0], acc[h][0]));
  }
  return pf;
}

template <int NH, int E>
void qk_scores_float(const float* q, int q_stride, int hd, const AttnCache& c, const Run* runs, int n_runs,
                     int span, float* s) {
  constexpr int HB = NH < 4 ? NH : 4;  // heads per pass: HB x 4 accumulators, 4 K vectors, one q vector
  // The 4 rows `ahead` on, spread over the hd / 16 steps of every head block as in qk_scores_int8: 4 · hd · E / 64
  // lines over (head blocks) · hd / 16 steps.
  constexpr int blocks = (NH + HB - 1) / HB, PFS = (E + blocks - 1) / blocks;
  const int ahead = prefetch_ahead(hd * E);
  for (int ri = 0; ri < n_runs; ++ri) {
    const uint8_t* k = c.k + int64_t(runs[ri].row) * c.row_bytes + c.head_off;
    float* out = s + runs[ri].off;
    const int len = runs[ri].len;
    int j = 0;
    for (; j + 4 <= len; j += 4) {  // all heads per 4 rows, so the rows are read from memory once
      LinePrefetch pf = head_rows(c.k, c, runs[ri].row + j + ahead, std::min(4, len - j - ahead), hd * E);
      for_head_blocks<NH, HB>([&](auto hb, int h0) {
        pf = qk_float_group<decltype(hb)::value, 4, E, PFS>(q + h0 * q_stride, q_stride, hd,
                                                            k + int64_t(j) * c.row_bytes, c.row_bytes,
                                                            out + h0 * span + j, span, pf);
      });
    }
    for (; j < len; ++j)
      for_head_blocks<NH, HB>([&](auto hb, int h0) {
        qk_float_group<decltype(hb)::value, 1, E>(q + h0 * q_stride, q_stride, hd, k + int64_t(j) * c.row_bytes,
                                                  c.row_bytes, out + h0 * span + j, span);
      });
  }
}

// The largest head_dim the integer Q·K path takes (its quantised queries live on the stack, and a dot of that many
// int16 products stays inside int32); longer heads convert.
constexpr int kQ8MaxDim = 512;

// Positions per tile of pv_int8 (even): the tile's V rows stay in L1 over the dims.
inline int pv_tile(int hd) { return std::min(256, hd >= 1024 ? 16 : 16384 / hd); }

// Q·K on the int8 cache in int16 (vpdpwssd, 32 products an instruction, twice an f32 FMA's): each query head is
// quantised to int16 codes with one scale s = max|q| / 16383 (14 bits and the sign, so a dot of 512 codes stays
// inside int32), so its error is at most s / 2 = max|q| / 32766 per element; the K codes are widened to int16 once
// for every head of the pass. The integer dot is exact; the score is it times s and the row's K scale. (An int8
// query, as llama.cpp's q8_0 one for a quantised K cache, runs as fast per product but moves the scores by about as
// much as the keys' own rounding: enough to flip near-tied greedy tokens on the test fixtures.)
// pf: PFS lines a 32-dim step; returned for the next head block (a copy, not a reference: __m512i is may_alias, so
// writes through a reference would keep the accumulators in memory).
template <int HB, int P, int PFS = 0>
inline LinePrefetch qk_int8_group(const int16_t* q16, int hd, const uint8_t* k, int row_bytes, const float* qscale,
                                  const float* ks, float* out, int span, LinePrefetch pf = {}) {
  __m512i acc[HB][P];
  for (int h = 0; h < HB; ++h)
    for (int p = 0; p < P; ++p) acc[h][p] = _mm512_setzero_si512();
  for (int d = 0; d < hd; d += 32) {
    for (int i = 0; i < PFS; ++i) pf.step();
    __m512i kx[P];
    for (int p = 0; p < P; ++p)
      kx[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + int64_t(p) * row_bytes + d)));
    for (int h = 0; h < HB; ++h) {
      const __m512i qv = _mm512_loadu_si512(q16 + h * hd + d);
      for (int p = 0; p < P; ++p) acc[h][p] = dpwssd(acc[h][p], kx[p], qv);
    }
  }
  for (int h = 0; h < HB; ++h) {
    if constexpr (P == 4) {
      const __m128 sc = _mm_mul_ps(_mm_cvtepi32_ps(hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3])),
                                   _mm_set1_ps(qscale[h]));
      _mm_storeu_ps(out + h * span, _mm_mul_ps(sc, _mm_loadu_ps(ks)));
    } else {
      out[h * span] = float(_mm512_reduce_add_epi32(acc[h][0])) * qscale[h] * ks[0];
    }
  }
  return pf;
}

template <int NH>
void qk_scores_int8(const float* q, int q_stride, int hd, const AttnCache& c, const Run* runs, int n_runs, int span,
                    float* s) {
  alignas(64) int16_t q16[NH * kQ8MaxDim];
  float qscale[NH];
  for (int h = 0; h < NH; ++h) {
    const float* qh = q + h * q_stride;
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qh + d)));
    const float amax = _mm512_reduce_max_ps(mx);
    qscale[h] = amax / 16383.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 16383.0f / amax : 0.0f);
    for (int d = 0; d < hd; d += 16) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qh + d), inv));  // round to nearest
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + h * hd + d), _mm512_cvtsepi32_epi16(qi));
    }
  }
  constexpr int HB = NH < 4 ? NH : 4;  // HB heads x 4 rows of accumulators
  // 4 rows' hd / 16 lines over the (head blocks) · hd / 32 steps of a 4-row block.
  constexpr int blocks = (NH + HB - 1) / HB, PFS = (2 + blocks - 1) / blocks;
  // What the block reads next as one stream of rows: the K rows of every run, then the V rows of P·V's first tile.
  // next_rows(r): up to 4 rows from row r of that stream (not across a run's end).
  const int v_rows = std::min(pv_tile(hd), runs[0].len);
  auto next_rows = [&](int r) {
    for (int ri = 0; ri < n_runs; r -= runs[ri].len, ++ri)
      if (r < runs[ri].len) return head_rows(c.k, c, runs[ri].row + r, std::min(4, runs[ri].len - r), hd);
    return head_rows(c.v, c, runs[0].row + r, std::min(4, v_rows - r), hd);
  };
  const int ahead = prefetch_ahead(hd);
  for (int ri = 0; ri < n_runs; ++ri) {
    const uint8_t* k = c.k + int64_t(runs[ri].row) * c.row_bytes + c.head_off;
    const float* ks = c.ks + runs[ri].row;
    float* out = s + runs[ri].off;
    const int len = runs[ri].len;
    int j = 0;
    for (; j + 4 <= len; j += 4) {  // all heads per 4 rows, so the rows are read from memory once
      // The 4 rows `ahead` on, PFS lines a step. With these rows as a burst here, P·V's next tile as a burst in its
      // first pass and neither the first V tile nor the next part's first K rows prefetched, attention over 128 cold
      // slots took 1.9x (512-dim heads, 1024 positions) and 1.1x (256, 512) as long (Zen 5, alternated in one
      // process; docs/benchmarks.md).
      LinePrefetch pf = next_rows(runs[ri].off + j + ahead);
      for_head_blocks<NH, HB>([&](auto hb, int h0) {
        pf = qk_int8_group<decltype(hb)::value, 4, PFS>(q16 + h0 * hd, hd, k + int64_t(j) * c.row_bytes,
                                                        c.row_bytes, qscale + h0, ks + j, out + h0 * span + j, span,
                                                        pf);
      });
    }
    for (; j < len; ++j)
      for_head_blocks<NH, HB>([&](auto hb, int h0) {
        qk_int8_group<decltype(hb)::value, 1>(q16 + h0 * hd, hd, k + int64_t(j) * c.row_bytes, c.row_bytes,
                                              qscale + h0, ks + j, out + h0 * span + j, span);
      });
  }
}

template <int NH, int E>
void qk_scores(const float* q, int q_stride, int hd, const AttnCache& c, const Run* runs, int n_runs, int span,
               float* s) {
  if constexpr (E == 1) {
    if (hd % 32 == 0 && hd <= kQ8MaxDim) return qk_scores_int8<NH>(q, q_stride, hd, c, runs, n_runs, span, s);
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
      // The next tile's tile · hd · E / 64 lines over the hd / (16 DB) passes of tile steps: E · DB / 4 a step, as
      // in pv_int8 (not all in the first pass).
      constexpr int PFS = (E * DB + 3) / 4;
      LinePrefetch pf = head_rows(c.v, c, runs[ri].row + t0 + tile, std::min(tile, runs[ri].len - t0 - tile), hd * E);
      for (int d = 0; d < hd; d += 16 * DB) {
        __m512 acc[NH][DB];
        for (int h = 0; h < NH; ++h)
          for (int b = 0; b < DB; ++b) acc[h][b] = _mm512_loadu_ps(out + h * out_stride + d + 16 * b);
        const uint8_t* v = v0;
        for (int j = 0; j < tn; ++j, v += c.row_bytes) {
          for (int i = 0; i < PFS; ++i) pf.step();
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

// P·V on the int8 cache in int16 (vpdpwssd: 32 products an instruction, twice an f32 FMA's): each head's weights
// (softmax normaliser and V scales folded in) become int16 codes with one scale for the whole span, and two
// positions' V codes are interleaved into int16 pairs that all heads share. The scale is the largest weight / 32767,
// or the weights' sum / 2^23 when that is larger (diffuse attention: it keeps the sum of codes * 127 inside int32),
// so the integer sums over the span are exact, whatever the tiles and ring runs: the result of a position does not
// depend on the ring's capacity (the chunk a slot was laid out with). The only error is the weights' rounding: at
// most 2^-16 of the largest weight per weight (or 2^-24 of their sum). With `more` (the caller attends the positions
// after the span next) the last tile prefetches their first K rows.
template <int NH>
void pv_int8(const float* w, int span, int hd, const AttnCache& c, const Run* runs, int n_runs, float* out,
             int out_stride, bool more) {
  // The integer sums go where the output will be (as int32), converted once at the end.
  for (int h = 0; h < NH; ++h) std::memset(out + h * out_stride, 0, sizeof(float) * hd);
  const int tile = pv_tile(hd);
  alignas(64) int16_t wq[NH][256 + 16];
  float wscale[NH];
  __m512 winv[NH];
  for (int h = 0; h < NH; ++h) {
    const float* wh = w + h * span;
    __m512 mx = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
    for (int j = 0; j < span; j += 16) {
      const __mmask16 k = span - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (span - j)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(k, wh + j);
      mx = _mm512_max_ps(mx, x);
      sm = _mm512_add_ps(sm, x);
    }
    const float m = std::max(_mm512_reduce_max_ps(mx) / 32767.0f, _mm512_reduce_add_ps(sm) / 8388608.0f);
    wscale[h] = m;
    winv[h] = _mm512_set1_ps(m > 0 ? 1.0f / m : 0.0f);
  }
  for (int ri = 0; ri < n_runs; ++ri) {
    for (int t0 = 0; t0 < runs[ri].len; t0 += tile) {
      const int tn = std::min(tile, runs[ri].len - t0), tp = (tn + 1) & ~1;
      const uint8_t* v0 = c.v + int64_t(runs[ri].row + t0) * c.row_bytes + c.head_off;
      for (int h = 0; h < NH; ++h) {
        const float* wh = w + h * span + runs[ri].off + t0;
        for (int j = 0; j < tp; j += 16) {  // codes past tn are 0 (the masked load), so an odd tile's pad adds 0
          const __mmask16 k = tn - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (tn - j)) - 1);
          const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, wh + j), winv[h]));
          _mm256_store_si256(reinterpret_cast<__m256i*>(&wq[h][j]), _mm512_cvtsepi32_epi16(qi));
        }
      }
      // The next tile's tile * hd / 64 lines, one a pair step over the hd / 32 passes of tile / 2 steps, while this
      // one is worked through (all in the first pass, they stalled the loads behind them).
      LinePrefetch pf = head_rows(c.v, c, runs[ri].row + t0 + tile, std::min(tile, runs[ri].len - t0 - tile), hd);
      if (more && ri + 1 == n_runs && t0 + tile >= runs[ri].len) {
        const int after = (runs[ri].row + runs[ri].len) % c.cap;
        pf = head_rows(c.k, c, after, std::min(prefetch_ahead(hd), c.cap - after), hd);
      }
      for (int d = 0; d < hd; d += 32) {
        __m512i acc[NH][2];
        for (int h = 0; h < NH; ++h) acc[h][0] = acc[h][1] = _mm512_setzero_si512();
        const uint8_t* v = v0 + d;
        for (int j = 0; j < tp; j += 2, v += 2 * c.row_bytes) {
          pf.step();
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(j + 1 < tn ? v + c.row_bytes : v));
          // int16 pairs (v_j, v_j+1) of dims [0..7 | 16..23] and [8..15 | 24..31] of the 32.
          const __m512i x = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));
          const __m512i y = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
          for (int h = 0; h < NH; ++h) {
            int32_t pair;
            std::memcpy(&pair, &wq[h][j], 4);
            const __m512i wv = _mm512_set1_epi32(pair);
            acc[h][0] = dpwssd(acc[h][0], wv, x);
            acc[h][1] = dpwssd(acc[h][1], wv, y);
          }
        }
        for (int h = 0; h < NH; ++h) {  // back to dims [0..15] and [16..31]
          float* o = out + h * out_stride + d;
          const __m512i lo = _mm512_shuffle_i32x4(acc[h][0], acc[h][1], 0x44);
          const __m512i hi = _mm512_shuffle_i32x4(acc[h][0], acc[h][1], 0xEE);
          _mm512_storeu_si512(o, _mm512_add_epi32(lo, _mm512_loadu_si512(o)));
          _mm512_storeu_si512(o + 16, _mm512_add_epi32(hi, _mm512_loadu_si512(o + 16)));
        }
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    float* o = out + h * out_stride;
    const __m512 sc = _mm512_set1_ps(wscale[h]);
    for (int d = 0; d < hd; d += 16)
      _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(o + d)), sc));
  }
}

template <int NH, int E>
void attend_block(const float* q, int q_stride, int hd, const AttnCache& c, int lo, int hi, float* out,
                  int out_stride, float* s, float* stats, bool more = false) {
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
    const float sum = _mm512_reduce_add_ps(sv);
    if (stats) stats[2 * h] = m, stats[2 * h + 1] = sum;
    // Fold the normaliser and each position's V scale into the weights.
    fold_weights<E>(sh, c, runs, n_runs, 1.0f / sum);
  }
  if constexpr (E == 1) {
    if (hd % 32 == 0) return pv_int8<NH>(s, span, hd, c, runs, n_runs, out, out_stride, more);
  }
  if constexpr (NH <= 4) {
    if (hd % 64 == 0) return pv_accumulate<NH, 4, E>(s, span, hd, c, runs, n_runs, out, out_stride);
  }
  if (hd % 32 == 0) return pv_accumulate<NH, 2, E>(s, span, hd, c, runs, n_runs, out, out_stride);
  pv_accumulate<NH, 1, E>(s, span, hd, c, runs, n_runs, out, out_stride);
}


// Folds a part (its nq heads' outputs, hd floats a head, and stats, ops.h) into the running result of the parts
// before it: out (normalised so far) and run (per head: the largest score so far and the sum of exponentials
// relative to it). attend_avx512 and attend_merge_parts_avx512 both fold through here, so they give the same bits.
inline void attend_fold_part(float* out, int out_stride, float* run, const float* part, const float* stats, int nq,
                             int hd) {
  for (int h = 0; h < nq; ++h) {
    const float m = std::max(run[2 * h], stats[2 * h]);
    const float a = run[2 * h + 1] * std::exp(run[2 * h] - m), b = stats[2 * h + 1] * std::exp(stats[2 * h] - m);
    const float l = a + b;
    const __m512 fa = _mm512_set1_ps(a / l), fb = _mm512_set1_ps(b / l);
    float* o = out + int64_t(h) * out_stride;
    const float* x = part + int64_t(h) * hd;
    for (int d = 0; d < hd; d += 16)
      _mm512_storeu_ps(o + d, _mm512_fmadd_ps(fa, _mm512_loadu_ps(o + d), _mm512_mul_ps(fb, _mm512_loadu_ps(x + d))));
    run[2 * h] = m;
    run[2 * h + 1] = l;
  }
}

// stats null: the whole span [lo, hi] as its attend_parts() parts folded in order (scratch: the part's scores, then
// a part's outputs and stats); else the one part [lo, hi], its stats to stats.
template <int NH, int E>
struct ZmmBlock {
  static void run(const float* q, int q_stride, int hd, const AttnCache& c, int lo, int hi, float* out,
                  int out_stride, float* s, float* stats) {
    if (stats) return attend_block<NH, E>(q, q_stride, hd, c, lo, hi, out, out_stride, s, stats);
    const int span = hi - lo + 1, n = attend_parts(span);
    float run[2 * NH];
    attend_block<NH, E>(q, q_stride, hd, c, lo, attend_part_start(lo, span, 1) - 1, out, out_stride, s, run, n > 1);
    float* part = s + NH * kAttendPartPositions;
    float* part_stats = part + NH * hd;
    for (int p = 1; p < n; ++p) {
      attend_block<NH, E>(q, q_stride, hd, c, attend_part_start(lo, span, p), attend_part_start(lo, span, p + 1) - 1,
                          part, hd, s, part_stats, p + 1 < n);
      attend_fold_part(out, out_stride, run, part, part_stats, NH, hd);
    }
  }
};

}  // namespace

void attend_avx512(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi, float* out,
                   int out_stride, float* scratch) {
  if (hd % 16) return attend(q, q_stride, nq, hd, c, lo, hi, out, out_stride, scratch);  // zmm reads 16 dims
  attend_in_blocks<ZmmBlock>(q, q_stride, nq, hd, c, lo, hi, out, out_stride, scratch);
}

void attend_avx512_part(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi,
                        float* out, int out_stride, float* scratch, float* stats) {
  attend_in_blocks<ZmmBlock>(q, q_stride, nq, hd, c, lo, hi, out, out_stride, scratch, stats);
}

void attend_merge_parts_avx512(const float* parts, const float* stats, int n_parts, int nq, int hd, float* out,
                               int out_stride) {
  merge_parts(parts, stats, n_parts, nq, hd, out, out_stride, attend_fold_part);
}

}  // namespace sg::ops
