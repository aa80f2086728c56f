// Scalar AMX tiles for the emulated test build (-DSG_KERNEL_EMULATION; see immintrin.h here).
// Included by gemm_amx.cpp in place of its inline-assembly tile primitives, with the same
// names and semantics: eight thread-local 16×64-byte tiles, tdpbssd per the Intel SDM.
// A tile instruction outside ldtilecfg … tilerelease traps, like the #UD it would raise.
// SG_EMULATED_TILE_LOSS_EVERY=N zeroes all tiles after every N-th tdpbssd, the way a KVM host
// that loses the tile state on preemption does, to exercise the guard and its fallback.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace sg::amx {

thread_local int8_t g_emu_tiles[8][1024];
thread_local bool g_emu_configured = false;
thread_local long g_emu_dp_count = 0;

inline long emulated_loss_every() {
  static const long every = [] {
    const char* e = std::getenv("SG_EMULATED_TILE_LOSS_EVERY");
    return e ? std::atol(e) : 0L;
  }();
  return every;
}

inline void load_tile_config() { g_emu_configured = true; }
inline void tile_release() { g_emu_configured = false; }

template <int T>
inline void tile_load(const void* p) {
  if (!g_emu_configured) __builtin_trap();
  std::memcpy(g_emu_tiles[T], p, 1024);
}
template <int T>
inline void tile_store(void* p) {
  if (!g_emu_configured) __builtin_trap();
  std::memcpy(p, g_emu_tiles[T], 1024);
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
  const int8_t* a = g_emu_tiles[A];  // 16 rows × 64 k
  const int8_t* b = g_emu_tiles[B];  // 16 rows of (4 k × 16 columns)
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 16; ++n) {
      int32_t s = 0;
      for (int kk = 0; kk < 64; ++kk) s += int32_t(a[r * 64 + kk]) * int32_t(b[(kk / 4) * 64 + n * 4 + kk % 4]);
      c[r * 16 + n] = int32_t(uint32_t(c[r * 16 + n]) + uint32_t(s));
    }
  std::memcpy(g_emu_tiles[C], c, sizeof c);
  const long every = emulated_loss_every();
  if (every && ++g_emu_dp_count % every == 0) std::memset(g_emu_tiles, 0, sizeof g_emu_tiles);
}

}  // namespace sg::amx
