// Scalar stand-ins for the AVX-512 intrinsics that gemm_vnni.cpp, gemm_amx.cpp, gemm_q8g_avx512.cpp and
// gemm_q8g_amx.cpp use, so the two backends' logic (blocking, biases, corrections, epilogues, tile guard) runs and is
// checked bit for bit against the AVX2 backend on a CPU without AVX-512/AMX. Only for the
// emulated test build (emulation/harness.cpp, driven by tests/test_kernels.py): it shadows
// <immintrin.h> through the include path, pulls in the real header, then renames the 512-bit
// types and intrinsics to the scalar versions below. Semantics follow the Intel SDM
// (vpdpbusd: u8 of the 2nd operand × s8 of the 3rd, wrapping int32 sums).
#pragma once
#include_next <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace emu {
struct V512 { alignas(64) int8_t b[64]; };
struct F512 { alignas(64) float f[16]; };
inline int32_t gi(const V512& v, int i) { int32_t x; std::memcpy(&x, v.b + 4 * i, 4); return x; }
inline void si(V512& v, int i, int32_t x) { std::memcpy(v.b + 4 * i, &x, 4); }
inline V512 set1_epi32(int32_t x) { V512 v; for (int i = 0; i < 16; ++i) si(v, i, x); return v; }
inline V512 set1_epi8(char x) { V512 v; std::memset(v.b, x, 64); return v; }
inline V512 setzero_si512() { return set1_epi8(0); }
inline V512 xor_si512(V512 a, V512 b) { for (int i = 0; i < 64; ++i) a.b[i] ^= b.b[i]; return a; }
inline V512 loadu_si512(const void* p) { V512 v; std::memcpy(v.b, p, 64); return v; }
inline V512 load_si512(const void* p) { if ((uintptr_t)p % 64) __builtin_trap(); return loadu_si512(p); }
inline void store_si512(void* p, V512 v) { if ((uintptr_t)p % 64) __builtin_trap(); std::memcpy(p, v.b, 64); }
inline V512 broadcast_i64x4(__m256i x) { V512 v; std::memcpy(v.b, &x, 32); std::memcpy(v.b + 32, &x, 32); return v; }
inline V512 and_si512(V512 a, V512 b) { for (int i = 0; i < 64; ++i) a.b[i] &= b.b[i]; return a; }
inline V512 mask_srli_epi16(V512 src, uint32_t k, V512 a, unsigned imm) {
  for (int i = 0; i < 32; ++i)
    if (k >> i & 1) {
      uint16_t x;
      std::memcpy(&x, a.b + 2 * i, 2);
      x = uint16_t(x >> imm);
      std::memcpy(src.b + 2 * i, &x, 2);
    }
  return src;
}
inline V512 srli_epi16(V512 a, unsigned imm) { return mask_srli_epi16(a, ~0u, a, imm); }
inline V512 set1_epi64(int64_t x) { V512 v; for (int i = 0; i < 8; ++i) std::memcpy(v.b + 8 * i, &x, 8); return v; }
inline V512 ternarylogic_epi32(V512 a, V512 b, V512 c, int imm) {
  for (int i = 0; i < 64; ++i) {
    uint8_t r = 0;
    for (int bit = 0; bit < 8; ++bit) {
      const int idx = ((uint8_t(a.b[i]) >> bit & 1) << 2) | ((uint8_t(b.b[i]) >> bit & 1) << 1) | (uint8_t(c.b[i]) >> bit & 1);
      r |= uint8_t((imm >> idx & 1) << bit);
    }
    a.b[i] = int8_t(r);
  }
  return a;
}
// 128-bit lanes: the low two from a, the high two from b, each picked by two bits of imm.
inline V512 shuffle_i64x2(V512 a, V512 b, int imm) {
  V512 v;
  for (int l = 0; l < 4; ++l) std::memcpy(v.b + 16 * l, (l < 2 ? a : b).b + 16 * (imm >> (2 * l) & 3), 16);
  return v;
}
inline V512 sub_epi8(V512 a, V512 b) { for (int i = 0; i < 64; ++i) a.b[i] = int8_t(a.b[i] - b.b[i]); return a; }
inline V512 sub_epi32(V512 a, V512 b) { for (int i = 0; i < 16; ++i) si(a, i, int32_t(uint32_t(gi(a, i)) - uint32_t(gi(b, i)))); return a; }
inline V512 add_epi32(V512 a, V512 b) { for (int i = 0; i < 16; ++i) si(a, i, int32_t(uint32_t(gi(a, i)) + uint32_t(gi(b, i)))); return a; }
inline V512 dpbusd_epi32(V512 src, V512 a, V512 b) {
  for (int i = 0; i < 16; ++i) {
    int32_t s = 0;
    for (int j = 0; j < 4; ++j) s += int32_t(uint8_t(a.b[4 * i + j])) * int32_t(b.b[4 * i + j]);
    si(src, i, int32_t(uint32_t(gi(src, i)) + uint32_t(s)));
  }
  return src;
}
inline V512 permutexvar_epi32(V512 idx, V512 a) { V512 v; for (int i = 0; i < 16; ++i) si(v, i, gi(a, gi(idx, i) & 15)); return v; }
inline V512 permutexvar_epi8(V512 idx, V512 a) { V512 v; for (int i = 0; i < 64; ++i) v.b[i] = a.b[idx.b[i] & 63]; return v; }
inline V512 shuffle_epi8(V512 a, V512 b) {
  V512 v;
  for (int i = 0; i < 64; ++i) v.b[i] = b.b[i] & 0x80 ? 0 : a.b[(i & ~15) + (b.b[i] & 15)];
  return v;
}
inline int32_t reduce_add_epi32(V512 a) { int32_t s = 0; for (int i = 0; i < 16; ++i) s += gi(a, i); return s; }
inline F512 setzero_ps() { F512 v; for (float& x : v.f) x = 0.f; return v; }
inline F512 set1_ps(float x) { F512 v; for (float& y : v.f) y = x; return v; }
inline F512 cvtepi32_ps(V512 a) { F512 v; for (int i = 0; i < 16; ++i) v.f[i] = float(gi(a, i)); return v; }
inline F512 mul_ps(F512 a, F512 b) { for (int i = 0; i < 16; ++i) a.f[i] = a.f[i] * b.f[i]; return a; }
inline F512 fmadd_ps(F512 a, F512 b, F512 c) { for (int i = 0; i < 16; ++i) a.f[i] = std::fma(a.f[i], b.f[i], c.f[i]); return a; }
inline F512 add_ps(F512 a, F512 b) { for (int i = 0; i < 16; ++i) a.f[i] += b.f[i]; return a; }
inline F512 loadu_ps(const float* p) { F512 v; std::memcpy(v.f, p, 64); return v; }
inline F512 load_ps(const float* p) { if ((uintptr_t)p % 64) __builtin_trap(); return loadu_ps(p); }
inline void storeu_ps(float* p, F512 v) { std::memcpy(p, v.f, 64); }
inline void store_ps(float* p, F512 v) { if ((uintptr_t)p % 64) __builtin_trap(); storeu_ps(p, v); }
inline V512 cvtepi8_epi32(__m128i a) { int8_t b[16]; std::memcpy(b, &a, 16); V512 v; for (int i = 0; i < 16; ++i) si(v, i, b[i]); return v; }
inline F512 cvtph_ps(__m256i h) { uint16_t u[16]; std::memcpy(u, &h, 32); F512 v; for (int i = 0; i < 16; ++i) v.f[i] = _cvtsh_ss(u[i]); return v; }
}  // namespace emu

#define __m512i emu::V512
#define __m512 emu::F512
#define _mm512_set1_epi32 emu::set1_epi32
#define _mm512_set1_epi8 emu::set1_epi8
#define _mm512_setzero_si512 emu::setzero_si512
#define _mm512_xor_si512 emu::xor_si512
#define _mm512_loadu_si512 emu::loadu_si512
#define _mm512_load_si512 emu::load_si512
#define _mm512_store_si512 emu::store_si512
#define _mm512_broadcast_i64x4 emu::broadcast_i64x4
#define _mm512_and_si512 emu::and_si512
#define _mm512_mask_srli_epi16 emu::mask_srli_epi16
#define _mm512_srli_epi16 emu::srli_epi16
#define _mm512_set1_epi64 emu::set1_epi64
#define _mm512_ternarylogic_epi32 emu::ternarylogic_epi32
#define _mm512_shuffle_i64x2 emu::shuffle_i64x2
#define _mm512_sub_epi8 emu::sub_epi8
#define _mm512_sub_epi32 emu::sub_epi32
#define _mm512_add_epi32 emu::add_epi32
#define _mm512_dpbusd_epi32 emu::dpbusd_epi32
#define _mm512_reduce_add_epi32 emu::reduce_add_epi32
#define _mm512_permutexvar_epi32 emu::permutexvar_epi32
#define _mm512_shuffle_epi8 emu::shuffle_epi8
#define _mm512_permutexvar_epi8 emu::permutexvar_epi8
#define _mm512_setzero_ps emu::setzero_ps
#define _mm512_set1_ps emu::set1_ps
#define _mm512_cvtepi32_ps emu::cvtepi32_ps
#define _mm512_mul_ps emu::mul_ps
#define _mm512_fmadd_ps emu::fmadd_ps
#define _mm512_add_ps emu::add_ps
#define _mm512_loadu_ps emu::loadu_ps
#define _mm512_load_ps emu::load_ps
#define _mm512_storeu_ps emu::storeu_ps
#define _mm512_store_ps emu::store_ps
#define _mm512_stream_ps emu::store_ps  // a streaming store: aligned, same bytes
#define _mm512_cvtph_ps emu::cvtph_ps
#define _mm512_cvtepi8_epi32 emu::cvtepi8_epi32
