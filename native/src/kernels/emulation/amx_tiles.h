// Scalar AMX tiles for the emulated test build (-DSG_KERNEL_EMULATION; see immintrin.h here).
// Included by gemm_amx.cpp in place of its inline-assembly tile primitives, with the same
// names and semantics: eight thread-local tiles of the configured rows × bytes, tdpbssd per the Intel SDM.
// A tile instruction outside ldtilecfg … tilerelease traps, like the #UD it would raise.
// SG_EMULATED_TILE_LOSS_EVERY=N zeroes all tiles after every N-th tdpbssd, the way a KVM host
// that loses the tile state on preemption does, to exercise the guard and its fallback.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace sg::amx {

inline thread_local int8_t g_emu_tiles[8][1024];
inline thread_local bool g_emu_configured = false;
inline thread_local long g_emu_dp_count = 0;
inline thread_local int g_emu_rows[8], g_emu_colsb[8];  // as ldtilecfg sets them (amx_tiles.h load_tile_config)

inline long emulated_loss_every() {
  static const long every = [] {
    const char* e = std::getenv("SG_EMULATED_TILE_LOSS_EVERY");
    return e ? std::atol(e) : 0L;
  }();
  return every;
}

inline void load_tile_config(int k_bytes = 64, int m_rows = 16) {
  g_emu_configured = true;
  for (int i = 0; i < 8; ++i) {
    g_emu_colsb[i] = i == 4 || i == 5 ? k_bytes : 64;
    g_emu_rows[i] = i >= 6 ? k_bytes / 4 : m_rows;
  }
  std::memset(g_emu_tiles, 0, sizeof g_emu_tiles);  // ldtilecfg zeroes the tiles
}
inline void tile_release() { g_emu_configured = false; }

// The configured rows × bytes of tile T, `stride` bytes apart; the rest of the tile reads as zeros (the SDM).
template <int T>
inline void tile_load(const void* p, long stride = 64) {
  if (!g_emu_configured) __builtin_trap();
  std::memset(g_emu_tiles[T], 0, 1024);
  for (int r = 0; r < g_emu_rows[T]; ++r)
    std::memcpy(g_emu_tiles[T] + r * 64, static_cast<const int8_t*>(p) + r * stride, g_emu_colsb[T]);
}
template <int T>
inline void tile_store(void* p, long stride = 64) {
  if (!g_emu_configured) __builtin_trap();
  for (int r = 0; r < g_emu_rows[T]; ++r)
    std::memcpy(static_cast<int8_t*>(p) + r * stride, g_emu_tiles[T] + r * 64, g_emu_colsb[T]);
}
template <int T>
inline void tile_zero() {
  if (!g_emu_configured) __builtin_trap();
  std::memset(g_emu_tiles[T], 0, 1024);
}
template <int C, int A, int B>
inline void tile_dp() {
  if (!g_emu_configured) __builtin_trap();
  int32_t c[256];
  std::memcpy(c, g_emu_tiles[C], sizeof c);
  const int8_t* a = g_emu_tiles[A];  // 16 rows × K bytes (K: A's configured bytes a row)
  const int8_t* b = g_emu_tiles[B];  // K / 4 rows of (4 k × 16 columns)
  const int K = g_emu_colsb[A];
  if (g_emu_rows[B] != K / 4) __builtin_trap();  // #UD on a real CPU
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 16; ++n) {
      int32_t s = 0;
      for (int kk = 0; kk < K; ++kk) s += int32_t(a[r * 64 + kk]) * int32_t(b[(kk / 4) * 64 + n * 4 + kk % 4]);
      c[r * 16 + n] = int32_t(uint32_t(c[r * 16 + n]) + uint32_t(s));
    }
  std::memcpy(g_emu_tiles[C], c, sizeof c);
  const long every = emulated_loss_every();
  if (every && ++g_emu_dp_count % every == 0) std::memset(g_emu_tiles, 0, sizeof g_emu_tiles);
}

}  // namespace sg::amx
