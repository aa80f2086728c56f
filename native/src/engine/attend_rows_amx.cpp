// The tile kernel's dot products on AMX tiles (attend_rows_amx.h). A tile multiply takes 16 vectors ×
// 64 bytes against 64 bytes × 16 columns at once, where the vpdpbusd loops take one vector's 4 bytes against 16
// columns: the Q·K and P·V of a 64-position tile are a handful of tile multiplies.
//   * Q·K: A = 16 query vectors' codes (64 dims a tile), B = 16 rows of the packed K tile (the same 64 dims × 16
//     positions): tdpbsud (A signed, B unsigned: K + 128), four accumulators for the tile's 64 positions.
//   * P·V: A = 16 vectors' u8 weight codes of the 64 positions, B = the 16 position quads × 16 dims of the packed V
//     tile: tdpbusd (A unsigned, B signed), four accumulators a round of 64 dims.
// And the f16 path's two dot products on bf16 tiles (tdpbf16ps), each as five tile products of exact bf16 parts
// (attend_rows_amx.h): Q·K with A = 16 vectors' 32 dims of one query plane, B = 16 pair rows × 16 positions of one
// K plane; P·V with A = 16 vectors' 32 weights of one plane, B = 16 position pairs × 16 dims of one V plane; four
// accumulators, the A tile alternating between two registers from term to term.
#include "attend_rows_amx.h"

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "amx_tiles.h"

namespace sg::ops {
namespace amx_attend {

using namespace sg::amx;

void begin() { load_tile_config(); }
void end() { tile_release(); }

void scores(const int8_t* q, long q_stride, const uint32_t* kt, int hd, int32_t* acc) {
  constexpr long kRow = 64 * 4;  // a packed K row: 64 positions of 4 bytes
  tile_zero<0>();
  tile_zero<1>();
  tile_zero<2>();
  tile_zero<3>();
  for (int kb = 0; kb < hd / 64; ++kb) {
    const uint32_t* b = kt + size_t(kb) * 16 * 64;  // dword rows 16 kb .. 16 kb + 15
    tile_load<4>(q + kb * 64, q_stride);
    tile_load<6>(b, kRow);
    tile_dp_su<0, 4, 6>();
    tile_load<7>(b + 16, kRow);
    tile_dp_su<1, 4, 7>();
    tile_load<6>(b + 32, kRow);
    tile_dp_su<2, 4, 6>();
    tile_load<7>(b + 48, kRow);
    tile_dp_su<3, 4, 7>();
  }
  tile_store<0>(acc, kRow);
  tile_store<1>(acc + 16, kRow);
  tile_store<2>(acc + 32, kRow);
  tile_store<3>(acc + 48, kRow);
}

void pv(const uint8_t* w, long w_stride, const uint32_t* vt, int hd, int nv, const float* wscale, const float* alpha,
        float* o, int o_stride) {
  const long row = long(hd) * 4;  // a packed V row: one position quad
  alignas(64) int32_t acc[16 * 64];
  tile_load<4>(w, w_stride);
  for (int d0 = 0; d0 < hd; d0 += 64) {
    tile_zero<0>();
    tile_zero<1>();
    tile_zero<2>();
    tile_zero<3>();
    tile_load<6>(vt + d0, row);
    tile_dp_us<0, 4, 6>();
    tile_load<7>(vt + d0 + 16, row);
    tile_dp_us<1, 4, 7>();
    tile_load<6>(vt + d0 + 32, row);
    tile_dp_us<2, 4, 6>();
    tile_load<7>(vt + d0 + 48, row);
    tile_dp_us<3, 4, 7>();
    tile_store<0>(acc, 256);
    tile_store<1>(acc + 16, 256);
    tile_store<2>(acc + 32, 256);
    tile_store<3>(acc + 48, 256);
    for (int v = 0; v < nv; ++v) {
      const __m512 ws = _mm512_set1_ps(wscale[v]), al = _mm512_set1_ps(alpha[v]);
      float* ov = o + size_t(v) * o_stride + d0;
      for (int b = 0; b < 4; ++b)
        _mm512_store_ps(ov + 16 * b,
                        fold_pv_sum(_mm512_load_si512(acc + v * 64 + 16 * b), ws, _mm512_load_ps(ov + 16 * b), al));
    }
  }
}

namespace {

// The five (query or weight plane, K or V plane) pairs of attend_rows_amx.h, the smallest first: (lo, hi), (mid, lo),
// (mid, hi), (hi, lo), (hi, hi), each added into the running sums in turn. Against a float64 attention (40 random
// cases, f16 K/V, 1,024 positions) the outputs' median relative error was 2.70e-7 in this order and 3.05e-7 largest
// first (the zmm f32 kernel: 6.74e-7, the ymm attend(): 2.57e-7).
constexpr int kTermA[kBf16Terms] = {2, 1, 1, 0, 0}, kTermB[kBf16Terms] = {0, 1, 0, 1, 0};

// C0..C3 += the A tile at a (`a_stride` bytes a row) times the four B tiles at b, b + b_step, ... (`b_stride` bytes a
// row), A in tile 4 + TA.
template <int TA>
inline void four_products(const void* a, long a_stride, const uint32_t* b, long b_step, long b_stride) {
  tile_load<4 + TA>(a, a_stride);
  tile_load<6>(b, b_stride);
  tile_dp_bf16<0, 4 + TA, 6>();
  tile_load<7>(b + b_step, b_stride);
  tile_dp_bf16<1, 4 + TA, 7>();
  tile_load<6>(b + 2 * b_step, b_stride);
  tile_dp_bf16<2, 4 + TA, 6>();
  tile_load<7>(b + 3 * b_step, b_stride);
  tile_dp_bf16<3, 4 + TA, 7>();
}

// The five terms of one step: a(x) is the A tile of plane x, b(y) the first B tile of plane y.
template <class FA, class FB>
inline void five_terms(FA a, long a_stride, FB b, long b_step, long b_stride) {
  four_products<0>(a(kTermA[0]), a_stride, b(kTermB[0]), b_step, b_stride);
  four_products<1>(a(kTermA[1]), a_stride, b(kTermB[1]), b_step, b_stride);
  four_products<0>(a(kTermA[2]), a_stride, b(kTermB[2]), b_step, b_stride);
  four_products<1>(a(kTermA[3]), a_stride, b(kTermB[3]), b_step, b_stride);
  four_products<0>(a(kTermA[4]), a_stride, b(kTermB[4]), b_step, b_stride);
}

inline void zero_accumulators() {
  tile_zero<0>();
  tile_zero<1>();
  tile_zero<2>();
  tile_zero<3>();
}

inline void store_accumulators(float* c, long stride) {
  tile_store<0>(c, stride);
  tile_store<1>(c + 16, stride);
  tile_store<2>(c + 32, stride);
  tile_store<3>(c + 48, stride);
}

}  // namespace

void scores_bf16(const uint16_t* q, long q_plane, const uint32_t* kt, long kt_plane, int hd, float* st, int st_stride) {
  constexpr long kRow = 64 * 4;  // a packed K row: 64 positions of a pair
  zero_accumulators();
  for (int d0 = 0; d0 < hd; d0 += 32) {  // 32 dims a step: 16 pair rows of K
    five_terms([&](int x) { return q + x * q_plane + d0; }, long(hd) * 2,
               [&](int y) { return kt + y * kt_plane + size_t(d0 / 2) * 64; }, 16, kRow);
  }
  store_accumulators(st, long(st_stride) * 4);
}

void pv_bf16(const uint16_t* w, long w_plane, const uint32_t* vt, long vt_plane, int hd, int nv, const float* alpha,
             float* o, int o_stride) {
  alignas(64) float acc[16 * 64];
  const long row = long(hd) * 4;  // a packed V row: one position pair
  for (int d0 = 0; d0 < hd; d0 += 64) {
    zero_accumulators();
    for (int j0 = 0; j0 < 64; j0 += 32)  // 32 positions a step: 16 pair rows of V
      five_terms([&](int x) { return w + x * w_plane + j0; }, 64 * 2,
                 [&](int y) { return vt + y * vt_plane + size_t(j0 / 2) * hd + d0; }, 16, row);
    store_accumulators(acc, 256);
    for (int v = 0; v < nv; ++v) {
      const __m512 al = _mm512_set1_ps(alpha[v]);
      float* ov = o + size_t(v) * o_stride + d0;
      for (int b = 0; b < 4; ++b)
        _mm512_store_ps(ov + 16 * b,
                        _mm512_fmadd_ps(_mm512_load_ps(ov + 16 * b), al, _mm512_load_ps(acc + v * 64 + 16 * b)));
    }
  }
}

}  // namespace amx_attend
}  // namespace sg::ops
