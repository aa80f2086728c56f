// Prefill attention with several query rows per K/V tile (ops.h attend_rows_avx512): a block of consecutive query
// rows of one sequence × the query heads of one KV head walks the cached positions in tiles of kTile. Each tile is
// converted once into the layouts of the dot products and then used by every query vector of the block (rows ×
// heads, at most kAttendRowsVectors), with an online (flash-style) softmax per vector. Packed tiles put 16 positions
// (Q·K) or 16 dims (P·V) in the lanes of a zmm, each lane's dword holding the elements its dot product reduces over.
//   * int8 K/V (vpdpbusd): Q·K takes the query quantised to int8 per vector (scale max|q|/127, quantize_row_i8)
//     against the K codes, made unsigned by +128 while packing (kt[d/4][position]: 4 dims a dword), the +128·Σq
//     taken off again exactly in int32. P·V takes the weights p·vscale as u8 codes on the scale of the tile's largest
//     weight against the V codes (vt[position/4][dim]: 4 positions a dword); the normaliser Σp is summed in f32 from
//     the unrounded p. The int32 sums are exact: the error is the query's and the weights' rounding.
//   * f16/f32 K/V (f32 FMA): the tile converted to f32 once (kt[d][position], vt[position][d]); only the order of the
//     f32 additions differs from attend(), as in attend_avx512. With amx_tiles on a CPU with AMX-BF16, f16 K/V go to
//     bf16 tiles instead (attend_rows_amx.h): the tile as exact hi + lo bf16 pairs (kt[d/2][position],
//     vt[position/2][d]), the queries and weights as exact hi + mid + lo, five tile products a dot product.
// docs/engine-api.md states the tolerance (tests/test_attention.py). Compiled with -mavx512f/bw/vl/vnni; the Model
// calls it only on the vnni and amx backends (whose CPUs have AVX-512 VNNI). With amx_tiles the int8 path's two dot
// products run on AMX tiles (attend_rows_amx.cpp), 16 vectors at a time: the same exact int32 sums, so the same bits.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attend_rows_amx.h"
#include "attend_common.h"
#include "attend_rows_scratch.h"
#include "exp_avx512.h"
#include "gemm.h"
#include "ops.h"

namespace sg::ops {

namespace {

constexpr int kNB = kTile / 16;  // zmm of scores per query vector and tile

// 16 cached elements of E bytes as f32 (int8 codes unscaled).
template <int E>
inline __m512 load16(const uint8_t* p) {
  if constexpr (E == 4) return _mm512_loadu_ps(p);
  else if constexpr (E == 2) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// kt[d][j] = dword d of row j (rows at byte offsets off[j] from base) ^ flip, for d < ndw (a multiple of 16),
// j < kTile: 16 × 16 dword blocks transposed in registers (unpack 32, unpack 64, two 128-bit lane shuffles).
inline void transpose_dwords(const uint8_t* base, const int32_t* off, int ndw, uint32_t flip, uint32_t* kt) {
  const __m512i f = _mm512_set1_epi32(int(flip));
  for (int jb = 0; jb < kTile; jb += 16)
    for (int d0 = 0; d0 < ndw; d0 += 16) {
      __m512i r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(base + off[jb + i] + 4 * d0);
      for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
      }
      // r[4i + k] holds, in 128-bit lane L, dword 4L + k of rows 4i .. 4i + 3.
      for (int k = 0; k < 4; ++k) {
        const __m512i a0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), a1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
        const __m512i b0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88),
                      b1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
        const __m512i col[4] = {_mm512_shuffle_i32x4(a0, b0, 0x88), _mm512_shuffle_i32x4(a1, b1, 0x88),
                                _mm512_shuffle_i32x4(a0, b0, 0xdd), _mm512_shuffle_i32x4(a1, b1, 0xdd)};
        for (int L = 0; L < 4; ++L)
          _mm512_store_si512(kt + (d0 + 4 * L + k) * kTile + jb, _mm512_xor_si512(col[L], f));
      }
    }
}

// One tile's K and V (positions t0 .. t0 + tn - 1) into s.kt / s.vt (and the int8 scales into s.ks / s.vs).
// Positions outside the block's [first, t0 + tn) (the ring may hold other positions there) and the padding up to
// kTile repeat position `first`: finite values, masked out of the softmax, zero weights.
template <int E>
void pack_tile(const AttnCache& c, int hd, int t0, int tn, int first, Scratch& s) {
  int32_t off[kTile];
  bool used[kTile];
  for (int j = 0; j < kTile; ++j) {
    used[j] = j < tn && t0 + j >= first;
    off[j] = int32_t(((used[j] ? t0 + j : first) % c.cap) * int64_t(c.row_bytes));
  }
  const uint8_t* kb = c.k + c.head_off;
  const uint8_t* vb = c.v + c.head_off;
  if constexpr (E == 1) {
    for (int j = 0; j < kTile; ++j) {
      const int row = (used[j] ? t0 + j : first) % c.cap;
      s.ks[j] = c.ks[row];
      s.vs[j] = used[j] ? c.vs[row] : 0.0f;
    }
    transpose_dwords(kb, off, hd / 4, 0x80808080u, s.kt);
  } else {
    if constexpr (E == 4) {
      transpose_dwords(kb, off, hd, 0, s.kt);
    } else {
      int32_t roff[kTile];
      for (int j = 0; j < kTile; ++j) {
        const uint8_t* k = kb + off[j];
        for (int d = 0; d < hd; d += 16) _mm512_store_ps(s.krows + j * hd + d, load16<E>(k + E * d));
        roff[j] = j * hd * 4;
      }
      transpose_dwords(reinterpret_cast<const uint8_t*>(s.krows), roff, hd, 0, s.kt);
    }
  }
  if constexpr (E == 1) {
    // vt[jq][d]: the codes of positions 4jq .. 4jq + 3 at dim d, byte-interleaved (vpdpbusd's signed operand).
    for (int jq = 0; jq < (tn + 3) / 4; ++jq) {
      const uint8_t* r[4];
      for (int i = 0; i < 4; ++i) r[i] = vb + off[4 * jq + i];
      uint32_t* out = s.vt + size_t(jq) * hd;
      for (int d = 0; d < hd; d += 16) {
        __m128i x[4];
        for (int i = 0; i < 4; ++i) x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[i] + d));
        const __m128i a0 = _mm_unpacklo_epi8(x[0], x[1]), a1 = _mm_unpackhi_epi8(x[0], x[1]);
        const __m128i b0 = _mm_unpacklo_epi8(x[2], x[3]), b1 = _mm_unpackhi_epi8(x[2], x[3]);
        __m128i* o = reinterpret_cast<__m128i*>(out + d);
        _mm_store_si128(o, _mm_unpacklo_epi16(a0, b0));
        _mm_store_si128(o + 1, _mm_unpackhi_epi16(a0, b0));
        _mm_store_si128(o + 2, _mm_unpacklo_epi16(a1, b1));
        _mm_store_si128(o + 3, _mm_unpackhi_epi16(a1, b1));
      }
    }
  } else {
    // vt[j][d]: position j's values as f32.
    for (int j = 0; j < tn; ++j) {
      const uint8_t* v = vb + off[j];
      float* out = reinterpret_cast<float*>(s.vt) + size_t(j) * hd;
      for (int d = 0; d < hd; d += 16) _mm512_store_ps(out + d, load16<E>(v + E * d));
    }
  }
}

// The f16 path on bf16 tiles (attend_rows_amx.h). x's f32 bits truncated to their top 16: the bf16 hi part, exactly
// an f32 again, and x - hi exactly the rest.
inline __m512 bf16_hi(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0xFFFF0000u))));
}
// Dwords of bf16 pairs: a's element in the low half, b's in the high (both exact bf16 values held as f32).
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(a), 16), _mm512_castps_si512(b));
}
// 32 f32 (a then b) as the three exact bf16 planes hi, mid, lo (32 each, `plane` elements apart): the top halves
// packed two registers at once (vpackusdw interleaves their 128-bit lanes, vpermq puts them back in order), one
// 64-byte store a plane.
inline void store_bf16_planes3(__m512 a, __m512 b, uint16_t* out, size_t plane) {
  const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
  __m512 x[2] = {a, b}, part[2][3];
  for (int h = 0; h < 2; ++h) {
    const __m512 hi = bf16_hi(x[h]), r = _mm512_sub_ps(x[h], hi), mid = bf16_hi(r);
    part[h][0] = hi, part[h][1] = mid, part[h][2] = _mm512_sub_ps(r, mid);
  }
  for (int i = 0; i < 3; ++i) {
    const __m512i top = _mm512_packus_epi32(_mm512_srli_epi32(_mm512_castps_si512(part[0][i]), 16),
                                            _mm512_srli_epi32(_mm512_castps_si512(part[1][i]), 16));
    _mm512_store_si512(out + i * plane, _mm512_permutexvar_epi64(order, top));
  }
}

// One tile's f16 K and V (as pack_tile) as the two bf16 planes each of the tiles' layouts: s.kt hi then lo
// (hd/2 × kTile dwords each), s.vt hi then lo (kTile/2 × hd dwords each). All kTile positions are packed (past tn
// they repeat `first`, as pack_tile's padding): the tiles multiply them all, with weights of zero.
void pack_tile_bf16(const AttnCache& c, int hd, int t0, int tn, int first, Scratch& s) {
  int32_t off[kTile];
  for (int j = 0; j < kTile; ++j)
    off[j] = int32_t((((j < tn && t0 + j >= first) ? t0 + j : first) % c.cap) * int64_t(c.row_bytes));
  // K: the f16 pairs of dims d, d + 1 as dwords, transposed to kt[d/2][j], then split in place into hi and lo.
  const size_t kplane = size_t(hd / 2) * kTile;
  transpose_dwords(c.k + c.head_off, off, hd / 2, 0, s.kt);
  for (size_t i = 0; i < kplane; i += 16) {
    const __m512i x = _mm512_load_si512(s.kt + i);
    const __m512 e0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)),
                 e1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
    const __m512 h0 = bf16_hi(e0), h1 = bf16_hi(e1);
    _mm512_store_si512(s.kt + i, bf16_pairs(h0, h1));
    _mm512_store_si512(s.kt + kplane + i, bf16_pairs(_mm512_sub_ps(e0, h0), _mm512_sub_ps(e1, h1)));
  }
  // V: positions 2p and 2p + 1 paired at each dim.
  const size_t vplane = size_t(kTile / 2) * hd;
  const uint8_t* vb = c.v + c.head_off;
  for (int p = 0; p < kTile / 2; ++p) {
    const uint8_t *r0 = vb + off[2 * p], *r1 = vb + off[2 * p + 1];
    uint32_t* out = s.vt + size_t(p) * hd;
    for (int d = 0; d < hd; d += 16) {
      const __m512 a = load16<2>(r0 + 2 * d), b = load16<2>(r1 + 2 * d);
      const __m512 ha = bf16_hi(a), hb = bf16_hi(b);
      _mm512_store_si512(out + d, bf16_pairs(ha, hb));
      _mm512_store_si512(out + vplane + d, bf16_pairs(_mm512_sub_ps(a, ha), _mm512_sub_ps(b, hb)));
    }
  }
}

// acc + the dword dot products of unsigned bytes a and signed bytes b (vpdpbusd). In asm with the accumulator
// tied: GCC 12's builtin has the score loop copy every accumulator once per use. By value, not through a reference:
// with the accumulator array's elements passed by reference GCC kept the whole array on the stack, and the Q·K and
// P·V loops loaded and stored every accumulator around every product (perf: 60% of a prefill 8192's attention
// samples on those loads).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// Vector v's int8 scores of 16 positions from b·16: the vpdpbusd / tdpbsud sums of q · (K + 128), minus 128·Σq,
// times the query's and the positions' scales.
inline __m512 scale_i8_scores(__m512i sum, int v, int b, const Scratch& s) {
  const __m512i dot = _mm512_sub_epi32(sum, _mm512_set1_epi32(s.qcorr[v]));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(s.qscale[v])), _mm512_load_ps(s.ks + 16 * b));
}

// Scores of MV query vectors (from v0) against the packed tile: s.st[v][j], scaled (int8: by qscale · kscale).
template <int MV, bool I8>
void tile_scores(int v0, int hd, Scratch& s) {
  const int ndw = I8 ? hd / 4 : hd, qdw = hd;
  const uint32_t* q = s.qc + size_t(v0) * qdw;
  using Acc = std::conditional_t<I8, __m512i, __m512>;
  Acc acc[MV][kNB];
  for (int v = 0; v < MV; ++v)
    for (int b = 0; b < kNB; ++b) acc[v][b] = Acc{};
  const uint32_t* kt = s.kt;
  for (int d = 0; d < ndw; ++d, kt += kTile) {
    __m512i kb[kNB];
    for (int b = 0; b < kNB; ++b) kb[b] = _mm512_load_si512(kt + 16 * b);
    for (int v = 0; v < MV; ++v) {
      const __m512i qb = _mm512_set1_epi32(int(q[v * qdw + d]));
      for (int b = 0; b < kNB; ++b) {
        if constexpr (I8) acc[v][b] = dpbusd(acc[v][b], kb[b], qb);
        else acc[v][b] = _mm512_fmadd_ps(_mm512_castsi512_ps(qb), _mm512_castsi512_ps(kb[b]), acc[v][b]);
      }
    }
  }
  for (int v = 0; v < MV; ++v) {
    float* st = s.st + size_t(v0 + v) * kTile;
    for (int b = 0; b < kNB; ++b) {
      __m512 x;
      if constexpr (I8) x = scale_i8_scores(acc[v][b], v0 + v, b, s);
      else x = acc[v][b];
      _mm512_store_ps(st + 16 * b, x);
    }
  }
}

template <bool I8>
void all_scores(int nv, int hd, Scratch& s) {
  int v = 0;
  for (; v + 4 <= nv; v += 4) tile_scores<4, I8>(v, hd, s);
  switch (nv - v) {
    case 3: return tile_scores<3, I8>(v, hd, s);
    case 2: return tile_scores<2, I8>(v, hd, s);
    case 1: return tile_scores<1, I8>(v, hd, s);
    default: return;
  }
}

// o[v] = o[v] · alpha[v] + Σ_j w[v][j] · V[j] for MV vectors from v0 and DB blocks of 16 dims from d0, over the
// tile's ns steps: positions (f32 FMA), or for int8 V quads of positions, u8 weight codes times V codes (vpdpbusd,
// exact in int32, then times wscale[v]).
template <int MV, int DB, bool I8>
void tile_pv(int v0, int d0, int hd, int ns, Scratch& s) {
  using Acc = std::conditional_t<I8, __m512i, __m512>;
  Acc acc[MV][DB];
  for (int v = 0; v < MV; ++v)
    for (int b = 0; b < DB; ++b) {
      if constexpr (I8) acc[v][b] = _mm512_setzero_si512();
      else acc[v][b] = _mm512_mul_ps(_mm512_load_ps(s.o + size_t(v0 + v) * hd + d0 + 16 * b),
                                     _mm512_set1_ps(s.alpha[v0 + v]));
    }
  const uint32_t* w = s.wt + size_t(v0) * kTile;
  for (int js = 0; js < ns; ++js) {
    const uint32_t* vt = s.vt + size_t(js) * hd + d0;
    __m512i vb[DB];
    for (int b = 0; b < DB; ++b) vb[b] = _mm512_load_si512(vt + 16 * b);
    for (int v = 0; v < MV; ++v) {
      const __m512i wb = _mm512_set1_epi32(int(w[v * kTile + js]));
      for (int b = 0; b < DB; ++b) {
        if constexpr (I8) acc[v][b] = dpbusd(acc[v][b], wb, vb[b]);
        else acc[v][b] = _mm512_fmadd_ps(_mm512_castsi512_ps(wb), _mm512_castsi512_ps(vb[b]), acc[v][b]);
      }
    }
  }
  for (int v = 0; v < MV; ++v)
    for (int b = 0; b < DB; ++b) {
      float* o = s.o + size_t(v0 + v) * hd + d0 + 16 * b;
      if constexpr (I8)
        _mm512_store_ps(o, fold_pv_sum(acc[v][b], _mm512_set1_ps(s.wscale[v0 + v]), _mm512_load_ps(o),
                                       _mm512_set1_ps(s.alpha[v0 + v])));
      else _mm512_store_ps(o, acc[v][b]);
    }
}

template <int DB, bool I8>
void all_pv(int nv, int hd, int ns, Scratch& s) {
  for (int d0 = 0; d0 < hd; d0 += 16 * DB) {
    int v = 0;
    for (; v + 4 <= nv; v += 4) tile_pv<4, DB, I8>(v, d0, hd, ns, s);
    switch (nv - v) {
      case 3: tile_pv<3, DB, I8>(v, d0, hd, ns, s); break;
      case 2: tile_pv<2, DB, I8>(v, d0, hd, ns, s); break;
      case 1: tile_pv<1, DB, I8>(v, d0, hd, ns, s); break;
      default: break;
    }
  }
}

// The int8 path's scores and P·V on AMX tiles (attend_rows_amx.h), per block of 16 vectors, with the epilogues of
// tile_scores and tile_pv (P·V's inside amx_attend::pv): the int32 sums are the vpdpbusd loops' exactly.
void amx_scores(int nv, int hd, Scratch& s) {
  alignas(64) int32_t acc[16 * kTile];
  for (int v0 = 0; v0 < nv; v0 += 16) {
    amx_attend::scores(reinterpret_cast<const int8_t*>(s.qc + size_t(v0) * hd), long(hd) * 4, s.kt, hd, acc);
    for (int v = v0; v < std::min(nv, v0 + 16); ++v)
      for (int b = 0; b < kNB; ++b)
        _mm512_store_ps(s.st + size_t(v) * kTile + 16 * b,
                        scale_i8_scores(_mm512_load_si512(acc + (v - v0) * kTile + 16 * b), v, b, s));
  }
}

void amx_pv(int nv, int hd, Scratch& s) {
  for (int v0 = 0; v0 < nv; v0 += 16)
    amx_attend::pv(reinterpret_cast<const uint8_t*>(s.wt + size_t(v0) * kTile), kTile * 4, s.vt, hd,
                   std::min(16, nv - v0), s.wscale + v0, s.alpha + v0, s.o + size_t(v0) * hd, hd);
}

void amx_scores_bf16(int nv, int hd, Scratch& s) {
  for (int v0 = 0; v0 < nv; v0 += 16)
    amx_attend::scores_bf16(s.qb + size_t(v0) * hd, long(s.qb_plane), s.kt, long(hd / 2) * kTile, hd,
                            s.st + size_t(v0) * kTile, kTile);
}

void amx_pv_bf16(int nv, int hd, Scratch& s) {
  for (int v0 = 0; v0 < nv; v0 += 16)
    amx_attend::pv_bf16(s.wb + size_t(v0) * kTile, long(s.wb_plane), s.vt, long(kTile / 2) * hd, hd,
                        std::min(16, nv - v0), s.alpha + v0, s.o + size_t(v0) * hd, hd);
}

// Row r attends [rows[r].lo, rows[r].hi] (ops.h AttnSpanRow).
template <int E>
void attend_rows(const AttnSpanRow* rows, int n_rows, int nq, int hd, const AttnCache& c, float* scratch,
                 bool amx_tiles) {
  constexpr bool I8 = E == 1;
  const int nv = n_rows * nq;
  Scratch s = carve_scratch(scratch, nv, hd);
  const bool amx = I8 && amx_tiles && hd % 64 == 0;
  const bool bf16 = E == 2 && amx_tiles && hd % 64 == 0 && amx_bf16_tiles_usable();
  if (amx) {
    std::memset(s.qc + size_t(nv) * hd, 0, sizeof(uint32_t) * size_t(round16(nv) - nv) * hd);
    std::memset(s.wt + size_t(nv) * kTile, 0, sizeof(uint32_t) * size_t(round16(nv) - nv) * kTile);
  }
  if (bf16)
    for (int i = 0; i < 3; ++i) {
      std::memset(s.qb + i * s.qb_plane + size_t(nv) * hd, 0, sizeof(uint16_t) * size_t(round16(nv) - nv) * hd);
      std::memset(s.wb + i * s.wb_plane + size_t(nv) * kTile, 0, sizeof(uint16_t) * size_t(round16(nv) - nv) * kTile);
    }
  if (amx || bf16) amx_attend::begin();
  // The query vectors (v = row · nq + head) in the dot-product format.
  for (int v = 0; v < nv; ++v) {
    const float* qv = rows[v / nq].q + size_t(v % nq) * hd;
    uint32_t* qc = s.qc + size_t(v) * hd;
    if constexpr (I8) {
      int8_t* codes = reinterpret_cast<int8_t*>(qc);
      quantize_row_i8(qv, hd, codes, &s.qscale[v]);
      int sum = 0;
      for (int d = 0; d < hd; ++d) sum += codes[d];
      s.qcorr[v] = 128 * sum;
    } else if (bf16) {
      for (int d = 0; d < hd; d += 32)
        store_bf16_planes3(_mm512_loadu_ps(qv + d), _mm512_loadu_ps(qv + d + 16), s.qb + size_t(v) * hd + d,
                           s.qb_plane);
    } else {
      std::memcpy(qc, qv, sizeof(float) * hd);
    }
    s.m[v] = -INFINITY;
    s.l[v] = 0.0f;
  }
  std::memset(s.o, 0, sizeof(float) * size_t(nv) * hd);

  int first, last;
  spans_union(rows, n_rows, &first, &last);
  // Tiles on the absolute grid of kTile positions: a vector's arithmetic is then the same whichever rows share its
  // block (prefill results do not depend on the chunking, docs/engine-api.md prefill(); a decode row's do not
  // depend on the batch, decode() with prefixes).
  for (int t0 = first / kTile * kTile; t0 <= last; t0 += kTile) {
    const int tn = std::min(kTile, last - t0 + 1);
    if (bf16) {
      pack_tile_bf16(c, hd, t0, tn, first, s);
      amx_scores_bf16(nv, hd, s);
    } else {
      pack_tile<E>(c, hd, t0, tn, first, s);
      if (amx) amx_scores(nv, hd, s);
      else all_scores<I8>(nv, hd, s);
    }
    // Online softmax: each vector's valid positions in this tile are [a, b] (its row's span).
    for (int v = 0; v < nv; ++v) {
      const AttnSpanRow& r = rows[v / nq];
      const int a = std::max(r.lo - t0, 0), b = std::min(r.hi - t0, tn - 1);
      uint32_t* w = s.wt + size_t(v) * kTile;
      if (a > b) {
        s.alpha[v] = 1.0f;
        s.wscale[v] = 0.0f;
        std::memset(w, 0, sizeof(uint32_t) * kTile);
        if (bf16)
          for (int i = 0; i < 3; ++i)
            std::memset(s.wb + i * s.wb_plane + size_t(v) * kTile, 0, sizeof(uint16_t) * kTile);
        continue;
      }
      const uint64_t valid = (b >= 63 ? ~uint64_t(0) : (uint64_t(2) << b) - 1) & ~((uint64_t(1) << a) - 1);
      const float* st = s.st + size_t(v) * kTile;
      const __m512 ninf = _mm512_set1_ps(-INFINITY);
      __m512 sb[kNB], mx = ninf;
      for (int i = 0; i < kNB; ++i) {
        sb[i] = _mm512_load_ps(st + 16 * i);
        mx = _mm512_max_ps(mx, _mm512_mask_blend_ps(__mmask16(valid >> (16 * i)), ninf, sb[i]));
      }
      const float m_new = std::max(s.m[v], _mm512_reduce_max_ps(mx));
      s.alpha[v] = s.m[v] == -INFINITY ? 0.0f : std::exp(s.m[v] - m_new);
      s.m[v] = m_new;
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int i = 0; i < kNB; ++i) {
        sb[i] = _mm512_maskz_mov_ps(__mmask16(valid >> (16 * i)), exp16(_mm512_sub_ps(sb[i], mv)));
        sum = _mm512_add_ps(sum, sb[i]);
        if constexpr (I8) sb[i] = _mm512_mul_ps(sb[i], _mm512_load_ps(s.vs + 16 * i));
      }
      s.l[v] = s.l[v] * s.alpha[v] + _mm512_reduce_add_ps(sum);
      if constexpr (I8) {
        // u8 codes of the weights on the scale of the tile's largest: byte j is position j, dword jq a quad.
        __m512 wm = sb[0];
        for (int i = 1; i < kNB; ++i) wm = _mm512_max_ps(wm, sb[i]);
        const float wmax = _mm512_reduce_max_ps(wm);
        s.wscale[v] = wmax / 255;
        const __m512 inv = _mm512_set1_ps(wmax > 0 ? 255 / wmax : 0.0f);
        for (int i = 0; i < kNB; ++i)
          _mm_store_si128(reinterpret_cast<__m128i*>(w) + i,
                          _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(sb[i], inv))));
      } else if (bf16) {
        for (int i = 0; i < kNB; i += 2)
          store_bf16_planes3(sb[i], sb[i + 1], s.wb + size_t(v) * kTile + 16 * i, s.wb_plane);
      } else {
        for (int i = 0; i < kNB; ++i) _mm512_store_ps(reinterpret_cast<float*>(w) + 16 * i, sb[i]);
      }
    }
    const int ns = I8 ? (tn + 3) / 4 : tn;
    if (amx) amx_pv(nv, hd, s);  // all 16 quads: past ns the weights are zero
    else if (bf16) amx_pv_bf16(nv, hd, s);  // all kTile positions, likewise
    else if (hd % 64 == 0) all_pv<4, I8>(nv, hd, ns, s);
    else all_pv<2, I8>(nv, hd, ns, s);
  }
  if (amx || bf16) amx_attend::end();
  for (int v = 0; v < nv; ++v) {
    store_span_stats(rows, nq, v, s.m[v], s.l[v]);
    const __m512 inv = _mm512_set1_ps(s.l[v] > 0 ? 1.0f / s.l[v] : 0.0f);
    float* ov = rows[v / nq].out + size_t(v % nq) * hd;
    const float* o = s.o + size_t(v) * hd;
    for (int d = 0; d < hd; d += 16) _mm512_storeu_ps(ov + d, _mm512_mul_ps(_mm512_load_ps(o + d), inv));
  }
}

}  // namespace

void attend_spans_avx512(const AttnSpanRow* rows, int n_rows, int nq, int hd, const AttnCache& c, float* scratch,
                         bool amx_tiles) {
  if (c.ks) attend_rows<1>(rows, n_rows, nq, hd, c, scratch, amx_tiles);
  else if (c.f32) attend_rows<4>(rows, n_rows, nq, hd, c, scratch, false);
  else attend_rows<2>(rows, n_rows, nq, hd, c, scratch, amx_tiles);
}

void attend_rows_avx512(const float* q, int q_row_stride, int rows, int nq, int hd, const AttnCache& c, int p0,
                        int window, float* out, int out_row_stride, float* scratch, bool amx_tiles) {
  AttnSpanRow spans[kAttendRowsVectorsAmx];  // rows <= the vectors a block holds
  prefill_spans(q, q_row_stride, rows, p0, window, out, out_row_stride, spans);
  attend_spans_avx512(spans, rows, nq, hd, c, scratch, amx_tiles);
}

}  // namespace sg::ops
