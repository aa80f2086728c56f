// The AMX halves of the tile kernel (attend_rows_avx512.cpp): the int8 path's two integer dot products on tiles,
// which give the exact int32 sums the vpdpbusd loops give, so the attention's bits do not depend on which ran; and the
// f16 path's two dot products on bf16 tiles, within the f32 path's tolerance.
// Compiled with the AMX flags (attend_rows_amx.cpp); call only where sg::amx_tiles_usable() said yes, between
// begin() and end() on the same thread.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sg::ops {

// The int8 P·V epilogue, one definition for the vpdpbusd loops (tile_pv) and the tiles (amx_attend::pv), so the two
// stay the same operations: o · alpha + (float)sum · wscale, one fused multiply-add.
inline __m512 fold_pv_sum(__m512i sum, __m512 wscale, __m512 o, __m512 alpha) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), wscale, _mm512_mul_ps(o, alpha));
}

namespace amx_attend {

// Configures the tiles on the calling thread (all 16 rows × 64 bytes) / releases them.
void begin();
void end();

// acc[v][j] (int32, 64 per row) = Σ_d q[v][d] · (K[j][d] + 128) for 16 query vectors × the tile's 64 positions:
// q holds 16 rows of int8 codes `q_stride` bytes apart (hd used); kt is the packed K tile (kt[d/4][j]: hd/4 rows of
// 64 dwords, the 4 bytes of dims 4(d/4) .. + 3 of position j, each + 128). hd % 64 == 0.
void scores(const int8_t* q, long q_stride, const uint32_t* kt, int hd, int32_t* acc);

// o[v][d] = fmaf(Σ_j w[v][j] · V[j][d], wscale[v], o[v][d] · alpha[v]) for the first nv (≤ 16) of 16 vectors × hd
// dims, the sum over the tile's 64 positions exact in int32 (fold_pv_sum, as tile_pv): w holds
// 16 rows of 64 u8 weight codes `w_stride` bytes apart; vt is the packed V tile (vt[j/4][d]: 16 rows of hd dwords,
// the codes of positions 4(j/4) .. + 3 at dim d); o rows are `o_stride` floats apart. hd % 64 == 0. Each round of
// 64 dims is folded into o while its sums are in L1.
void pv(const uint8_t* w, long w_stride, const uint32_t* vt, int hd, int nv, const float* wscale, const float* alpha,
        float* o, int o_stride);

// The f16 K/V path on AMX-BF16 tiles (sg::amx_bf16_tiles_usable()). A bf16 has 8 significant bits: an f16 K or V
// element (11) is the exact sum of two, hi + lo (hi its f32 bits truncated to the top 16, lo the rest), and an f32
// query element or softmax weight (24) of three, hi + mid + lo. Each dot product is then the sum of five bf16 dot
// products, (lo, hi) + (mid, lo) + (mid, hi) + (hi, lo) + (hi, hi) of (query or weight, K or V), the smallest first,
// every product exact in f32; only lo · lo (below 2^-24 of the element products) is left out. tdpbf16ps sums them
// in f32 in its own order: the results are the f32 path's within the tolerance docs/engine-api.md states for it.
// Planes: `plane` elements apart, in the order hi, mid, lo (three for the query and the weights) or hi, lo (two for
// K and V).
constexpr int kBf16Terms = 5;

// st[v][j] (f32, 64 a row, `st_stride` floats apart) = Σ_d q[v][d] · K[j][d] for 16 query vectors × the tile's 64
// positions: q holds three planes of 16 rows of hd bf16 (row r at r·hd), kt two planes of the packed K tile
// (kt[d/2][j]: hd/2 rows of 64 dwords, the bf16 pair of dims d, d + 1 of position j, low half first). hd % 32 == 0.
void scores_bf16(const uint16_t* q, long q_plane, const uint32_t* kt, long kt_plane, int hd, float* st, int st_stride);

// o[v][d] = o[v][d] · alpha[v] + Σ_j w[v][j] · V[j][d] (one fused multiply-add) for the first nv (≤ 16) of 16
// vectors × hd dims over the tile's 64 positions: w holds three planes of 16 rows of 64 bf16 weights (row r at
// r·64), vt two planes of the packed V tile (vt[j/2][d]: 32 rows of hd dwords, the bf16 pair of positions j, j + 1
// at dim d); o rows are `o_stride` floats apart. hd % 64 == 0.
void pv_bf16(const uint16_t* w, long w_plane, const uint32_t* vt, long vt_plane, int hd, int nv, const float* alpha,
             float* o, int o_stride);

}  // namespace amx_attend
}  // namespace sg::ops
