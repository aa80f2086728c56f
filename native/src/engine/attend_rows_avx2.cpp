// The tile attention kernel on ymm (ops.h attend_rows_avx2, attend_spans_avx2): attend_rows_avx512.cpp's design for
// AVX2 hosts. A block of query vectors (rows × the query heads of one KV head, at most kAttendRowsVectors) walks the
// cached positions in tiles of kTile on the absolute position grid; each tile is converted once into f32 layouts of
// the two dot products and then used by every vector of the block, with an online (flash-style) softmax per vector.
//   * K as kt[d][position] (8 × 8 blocks of cache rows transposed in registers), so the scores of 16 positions are
//     two FMA chains against one broadcast query element; V as vt[position][d]. Both in slices of 16 (positions of
//     K, dims of V), each slice contiguous: the register blocks below read one slice from start to end. (Laid out
//     whole, a slice's lines are 256 B (K) or 4·hd B (V) apart and map to 16 (K) or 2-4 (V) of L1's 64 sets, more
//     lines than their ways hold: E2B's prefill attention took 550-568 ms that way against attend()'s 520-529,
//     492-501 sliced; Zen 3.)
//   * Every cache type goes through f32 FMAs: f16 and f32 elements convert exactly, and so do int8 codes, whose
//     row scales are applied as attend() applies them (K's to the score, V's folded into the weight). Only the order
//     of the f32 additions differs from attend(): the tolerance of the zmm kernel's f32 path, for int8 caches too.
// AVX2 has no exact int8 dot product with an unsigned operand (vpmaddubsw saturates): the zmm kernel's int8 path
// (int8 queries, u8 weights) would cost more uops per product here than the f32 FMA does.
// Register blocks: 6 vectors × 16 positions (scores) or × 16 dims (P·V), 12 accumulators, two tile vectors and a
// broadcast; at hd = 256 a tile's K and V take 64 KB each, the query block 1 KB a vector.
// Compiled with -mavx2 -mfma -mf16c; the Model calls it on the avx2 backend (docs/engine-api.md).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attend_common.h"
#include "attend_rows_scratch.h"
#include "ops.h"
#include "ymm_common.h"

namespace sg::ops {

namespace {

constexpr int kNB = kTile / 8;  // ymm of scores per query vector and tile
constexpr int kMV = 6;          // query vectors per register block

// r[i] holds row i of an 8 × 8 block of floats; afterwards r[j] holds column j.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // per 128-bit lane: r_i[0] r_i+1[0] r_i[1] r_i+1[1]
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // r_i[2] r_i+1[2] r_i[3] r_i+1[3]
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // column 0 (lane 1: 4) of rows i .. i + 3
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);  // 1 (5)
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);  // 2 (6)
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);  // 3 (7)
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}

// One tile's K and V (positions t0 .. t0 + tn - 1, of which ja .. tn - 1 are the block's) into s.kt / s.vt as f32
// (and the int8 scales into s.ks / s.vs): K for the slices all_scores reads, V for the positions all_pv reads.
// Positions outside the block's [first, t0 + tn) (the ring may hold other positions there) and the padding up to
// the slice's end repeat position `first`: finite values, masked out of the softmax, zero weights.
template <int E>
void pack_tile(const AttnCache& c, int hd, int t0, int ja, int tn, int first, Scratch& s) {
  int32_t off[kTile];
  bool used[kTile];
  for (int j = 0; j < kTile; ++j) {
    used[j] = j < tn && t0 + j >= first;
    const int row = (used[j] ? t0 + j : first) % c.cap;
    off[j] = int32_t(row * int64_t(c.row_bytes));
    if constexpr (E == 1) {
      s.ks[j] = c.ks[row];
      s.vs[j] = used[j] ? c.vs[row] : 0.0f;
    }
  }
  const uint8_t* kb = c.k + c.head_off;
  const uint8_t* vb = c.v + c.head_off;
  for (int jb = ja / 16 * 16; jb < round16(tn); jb += 8) {
    float* kt = reinterpret_cast<float*>(s.kt) + size_t(jb / 16) * hd * 16 + jb % 16;  // its slice, its half
    for (int d0 = 0; d0 < hd; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load_kv8<E>(kb + off[jb + i], d0);
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(kt + size_t(d0 + i) * 16, r[i]);
    }
  }
  float* vt = reinterpret_cast<float*>(s.vt);
  for (int j = ja; j < tn; ++j)
    for (int d = 0; d < hd; d += 8)
      _mm256_store_ps(vt + size_t(d / 16) * kTile * 16 + j * 16 + d % 16, load_kv8<E>(vb + off[j], d));
}

// Scores of MV query vectors (from v0) against positions j0 .. j0 + 15 of the packed tile: s.st[v][j] (int8: times
// the position's K scale, as attend()).
template <int MV, bool I8>
void tile_scores(int v0, int j0, int hd, Scratch& s) {
  const float* q = reinterpret_cast<const float*>(s.qc) + size_t(v0) * hd;
  const float* kt = reinterpret_cast<const float*>(s.kt) + size_t(j0) * hd;  // slice j0 / 16
  __m256 acc[MV][2];
  for (int v = 0; v < MV; ++v) acc[v][0] = acc[v][1] = _mm256_setzero_ps();
  // do-while (hd > 0): with a loop that may run zero times GCC 12 keeps the accumulators on the stack, stored every
  // step, and the loop runs at the store port's rate.
  int d = 0;
  do {
    const __m256 k0 = _mm256_load_ps(kt), k1 = _mm256_load_ps(kt + 8);
    for (int v = 0; v < MV; ++v) {
      const __m256 qb = _mm256_broadcast_ss(q + size_t(v) * hd + d);
      acc[v][0] = _mm256_fmadd_ps(qb, k0, acc[v][0]);
      acc[v][1] = _mm256_fmadd_ps(qb, k1, acc[v][1]);
    }
    kt += 16;
  } while (++d < hd);
  for (int v = 0; v < MV; ++v)
    for (int b = 0; b < 2; ++b) {
      __m256 x = acc[v][b];
      if constexpr (I8) x = _mm256_mul_ps(x, _mm256_load_ps(s.ks + j0 + 8 * b));
      _mm256_store_ps(s.st + size_t(v0 + v) * kTile + j0 + 8 * b, x);
    }
}

// f(std::integral_constant<int, MV>, v0) for the register blocks of nv vectors: kMV at a time, then the rest.
template <class F>
void in_vector_blocks(int nv, F&& f) {
  int v = 0;
  for (; v + kMV <= nv; v += kMV) f(std::integral_constant<int, kMV>{}, v);
  switch (nv - v) {
    case 5: return f(std::integral_constant<int, 5>{}, v);
    case 4: return f(std::integral_constant<int, 4>{}, v);
    case 3: return f(std::integral_constant<int, 3>{}, v);
    case 2: return f(std::integral_constant<int, 2>{}, v);
    case 1: return f(std::integral_constant<int, 1>{}, v);
    default: return;
  }
}

// The slices holding positions [ja, jb) of the tile; the others (before the block's first position, past its last)
// are left as they are: every vector masks them out.
template <bool I8>
void all_scores(int nv, int hd, int ja, int jb, Scratch& s) {
  for (int j0 = ja / 16 * 16; j0 < jb; j0 += 16)  // a slice of K (16 KB at hd = 256) for every vector
    in_vector_blocks(nv, [&](auto mv, int v) { tile_scores<decltype(mv)::value, I8>(v, j0, hd, s); });
}

// o[v] = o[v] · alpha[v] + Σ_j w[v][j] · V[j] for MV vectors from v0 and dims d0 .. d0 + 15, over the tile's
// positions [ja, jb) (ja < jb; the weights elsewhere are zero).
template <int MV>
void tile_pv(int v0, int d0, int hd, int ja, int jb, Scratch& s) {
  __m256 acc[MV][2];
  for (int v = 0; v < MV; ++v) {
    const __m256 a = _mm256_set1_ps(s.alpha[v0 + v]);
    const float* o = s.o + size_t(v0 + v) * hd + d0;
    acc[v][0] = _mm256_mul_ps(_mm256_load_ps(o), a);
    acc[v][1] = _mm256_mul_ps(_mm256_load_ps(o + 8), a);
  }
  const float* w = reinterpret_cast<const float*>(s.wt) + size_t(v0) * kTile;
  const float* vt = reinterpret_cast<const float*>(s.vt) + size_t(d0) * kTile + 16 * ja;  // slice d0 / 16
  int j = ja;
  do {  // as tile_scores
    const __m256 x0 = _mm256_load_ps(vt), x1 = _mm256_load_ps(vt + 8);
    for (int v = 0; v < MV; ++v) {
      const __m256 wb = _mm256_broadcast_ss(w + size_t(v) * kTile + j);
      acc[v][0] = _mm256_fmadd_ps(wb, x0, acc[v][0]);
      acc[v][1] = _mm256_fmadd_ps(wb, x1, acc[v][1]);
    }
    vt += 16;
  } while (++j < jb);
  for (int v = 0; v < MV; ++v) {
    float* o = s.o + size_t(v0 + v) * hd + d0;
    _mm256_store_ps(o, acc[v][0]);
    _mm256_store_ps(o + 8, acc[v][1]);
  }
}

void all_pv(int nv, int hd, int ja, int jb, Scratch& s) {
  for (int d0 = 0; d0 < hd; d0 += 16)  // a slice of V (4 KB) for every vector
    in_vector_blocks(nv, [&](auto mv, int v) { tile_pv<decltype(mv)::value>(v, d0, hd, ja, jb, s); });
}

// Row r attends [rows[r].lo, rows[r].hi] (ops.h AttnSpanRow).
template <int E>
void attend_rows(const AttnSpanRow* rows, int n_rows, int nq, int hd, const AttnCache& c, float* scratch) {
  constexpr bool I8 = E == 1;
  const int nv = n_rows * nq;
  Scratch s = carve_scratch(scratch, nv, hd);
  float* const qc = reinterpret_cast<float*>(s.qc);
  for (int v = 0; v < nv; ++v) {
    std::memcpy(qc + size_t(v) * hd, rows[v / nq].q + size_t(v % nq) * hd, sizeof(float) * hd);
    s.m[v] = -INFINITY;
    s.l[v] = 0.0f;
  }
  std::memset(s.o, 0, sizeof(float) * size_t(nv) * hd);

  int first, last;
  spans_union(rows, n_rows, &first, &last);
  // Tiles on the absolute grid of kTile positions: a vector's arithmetic is then the same whichever rows share its
  // block (attend_rows_avx512.cpp).
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int t0 = first / kTile * kTile; t0 <= last; t0 += kTile) {
    const int tn = std::min(kTile, last - t0 + 1), ja = std::max(first - t0, 0);
    pack_tile<E>(c, hd, t0, ja, tn, first, s);
    all_scores<I8>(nv, hd, ja, tn, s);
    // Online softmax: each vector's valid positions in this tile are [a, b] (its row's span).
    for (int v = 0; v < nv; ++v) {
      const AttnSpanRow& r = rows[v / nq];
      const int a = std::max(r.lo - t0, 0), b = std::min(r.hi - t0, tn - 1);
      float* w = reinterpret_cast<float*>(s.wt) + size_t(v) * kTile;
      if (a > b) {
        s.alpha[v] = 1.0f;
        std::memset(w, 0, sizeof(float) * kTile);
        continue;
      }
      const __m256i below = _mm256_set1_epi32(a - 1), above = _mm256_set1_epi32(b + 1);
      __m256 valid[kNB], sb[kNB], mx = ninf;
      const float* st = s.st + size_t(v) * kTile;
      for (int i = 0; i < kNB; ++i) {
        const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i));
        valid[i] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(j, below), _mm256_cmpgt_epi32(above, j)));
        sb[i] = _mm256_load_ps(st + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, sb[i], valid[i]));
      }
      const float m_new = std::max(s.m[v], hmax(mx));
      s.alpha[v] = s.m[v] == -INFINITY ? 0.0f : std::exp(s.m[v] - m_new);
      s.m[v] = m_new;
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int i = 0; i < kNB; ++i) {
        __m256 p = _mm256_and_ps(valid[i], exp8(_mm256_sub_ps(sb[i], mv)));
        sum = _mm256_add_ps(sum, p);
        if constexpr (I8) p = _mm256_mul_ps(p, _mm256_load_ps(s.vs + 8 * i));
        _mm256_store_ps(w + 8 * i, p);
      }
      s.l[v] = s.l[v] * s.alpha[v] + hsum(sum);
    }
    all_pv(nv, hd, ja, tn, s);
  }
  for (int v = 0; v < nv; ++v) {
    store_span_stats(rows, nq, v, s.m[v], s.l[v]);
    const __m256 inv = _mm256_set1_ps(s.l[v] > 0 ? 1.0f / s.l[v] : 0.0f);
    float* ov = rows[v / nq].out + size_t(v % nq) * hd;
    const float* o = s.o + size_t(v) * hd;
    for (int d = 0; d < hd; d += 8) _mm256_storeu_ps(ov + d, _mm256_mul_ps(_mm256_load_ps(o + d), inv));
  }
}

}  // namespace

void attend_spans_avx2(const AttnSpanRow* rows, int n_rows, int nq, int hd, const AttnCache& c, float* scratch) {
  if (c.ks) attend_rows<1>(rows, n_rows, nq, hd, c, scratch);
  else if (c.f32) attend_rows<4>(rows, n_rows, nq, hd, c, scratch);
  else attend_rows<2>(rows, n_rows, nq, hd, c, scratch);
}

void attend_rows_avx2(const float* q, int q_row_stride, int rows, int nq, int hd, const AttnCache& c, int p0,
                      int window, float* out, int out_row_stride, float* scratch) {
  AttnSpanRow spans[kAttendRowsVectors];  // rows <= the vectors a block holds
  prefill_spans(q, q_row_stride, rows, p0, window, out, out_row_stride, spans);
  attend_spans_avx2(spans, rows, nq, hd, c, scratch);
}

}  // namespace sg::ops
