// The prefill tile kernel's int8 dot products on AMX tiles (attend_rows_amx.h). A tile multiply takes 16 vectors ×
// 64 bytes against 64 bytes × 16 columns at once, where the vpdpbusd loops take one vector's 4 bytes against 16
// columns: the Q·K and P·V of a 64-position tile are a handful of tile multiplies.
//   * Q·K: A = 16 query vectors' codes (64 dims a tile), B = 16 rows of the packed K tile (the same 64 dims × 16
//     positions): tdpbsud (A signed, B unsigned: K + 128), four accumulators for the tile's 64 positions.
//   * P·V: A = 16 vectors' u8 weight codes of the 64 positions, B = the 16 position quads × 16 dims of the packed V
//     tile: tdpbusd (A unsigned, B signed), four accumulators a round of 64 dims.
#include "attend_rows_amx.h"

#include <immintrin.h>

#include <cstddef>

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

}  // namespace amx_attend
}  // namespace sg::ops
