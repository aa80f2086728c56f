// The AMX tile primitives: the only inline assembly of the AMX code (gemm_amx.cpp, gemm_q8g_amx.cpp, the engine's
// prefill attention in attend_rows_amx.cpp). Include only from translation units built with the AMX flags, and run
// only after cpu_supports(Backend::Amx) (and, per thread, the tile permission: amx_request_permission). In the
// emulated test build (-DSG_KERNEL_EMULATION) this header gives emulation/amx_tiles.h instead: the same names, on
// scalar tiles.
//
// Compiler traps handled here (see the design notes): GCC's _tile_loadconfig tells the compiler it reads 8 bytes,
// and its _tile_loadd reads "no memory", so stores to the 64-byte config or to a scratch tile may be elided or sunk
// past the load. The config is a fully initialised 64-byte-aligned struct passed to our own ldtilecfg as a
// whole-object memory operand after a compiler barrier, and every tile load and store carries a "memory" clobber.
#pragma once

#ifdef SG_KERNEL_EMULATION
#include "emulation/amx_tiles.h"  // scalar tiles for the emulated test build
#else

#include <cstdint>
#include <cstring>

namespace sg::amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads exactly 64 bytes");

// Palette 1 with k_bytes inputs a product (4 to 64, a multiple of 4) and m_rows rows (1 to 16): tmm0-3 (the int32
// sums) m_rows rows × 64 bytes, tmm4-5 (A) m_rows rows × k_bytes, tmm6-7 (B) k_bytes / 4 rows × 64 bytes. The
// default: every tile 16 rows × 64 bytes. Fewer rows, fewer bytes moved and multiplied (a decode batch of 8).
inline void load_tile_config(int k_bytes = 64, int m_rows = 16) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = i == 4 || i == 5 ? k_bytes : 64;
    cfg.rows[i] = i >= 6 ? k_bytes / 4 : m_rows;
  }
  asm volatile("" ::: "memory");
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}
inline void tile_release() { asm volatile("tilerelease" ::: "memory"); }

// Tile T from / to its rows (of its configured bytes), `stride` bytes apart.
template <int T>
inline void tile_load(const void* p, long stride = 64) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* p, long stride = 64) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
// tmm[C] += tmm[A] · tmm[B] in int32, the bytes of A and B signed (tdpbssd), A signed and B unsigned (tdpbsud) or
// A unsigned and B signed (tdpbusd).
template <int C, int A, int B>
inline void tile_dp() {
  asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
template <int C, int A, int B>
inline void tile_dp_su() {
  asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
template <int C, int A, int B>
inline void tile_dp_us() {
  asm volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
// tmm[C] += tmm[A] · tmm[B] in f32 from bf16 pairs (tdpbf16ps, AMX-BF16): each pair's two products, exact in f32,
// fused into C in turn with round-to-nearest-even, denormal inputs and outputs flushed to zero.
template <int C, int A, int B>
inline void tile_dp_bf16() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

}  // namespace sg::amx

#endif  // SG_KERNEL_EMULATION
