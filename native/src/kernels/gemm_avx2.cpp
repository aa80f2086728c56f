// The AVX2 backend (compiled with -mavx2 -mfma -mf16c; called only when CPUID says so).
//
// Weights are read straight from the file's tile order: one 64-byte tile row holds 16 columns
// × 4 consecutive k, i.e. two ymm of 8 columns whose 32-bit lanes are 4 k of one column, so a
// broadcast 4-byte group of one activation row multiplies a whole ymm.
//
// Exact int32 sums without vpmaddubsw saturation:
//   q8c (s8 × s8): the sign trick. |w| is the unsigned operand (computed once per tile row,
//       shared by the register block's rows) and a·sign(w) the signed one; |products| ≤
//       127·127, a pair ≤ 32258 < 32767. Then vpmaddwd with ones → int32.
//   q4g: the nibble is turned into the unsigned w + 8 ∈ [0, 15] ((v ^ 8) for two's-complement
//       int4); a pair is ≤ 2·15·127 = 3810, so 8 tile rows (32 k) are summed in int16
//       (≤ 30480) before one vpmaddwd. Σ(w+8)·a − 8·Σa is exact; Σa per 64-block is
//       QAct.rowsum.
// The float epilogue follows the contract in gemm.h to the letter.
#include <immintrin.h>

#include <cstring>

#include "kernels_impl.h"

namespace sg::detail {
namespace {

// Software prefetch distance for the int4 weight stream (bytes ahead of the tile rows being
// read): 2 KB measured best for decode from DRAM on Zen 3, over the hardware prefetcher alone.
constexpr int kPrefetchAhead = 2048;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// MR activation rows (consecutive rows of one 16-row block) × one 16-column block, int8.
// A: the packed row at k-block 0 (k-block kb of the same row is at A + kb·1024).
// B: the column block's strip (KB tiles of 1024 bytes).
template <int MR>
void q8c_block(const int8_t* A, const int8_t* B, int KB, const float* a_scale, const float* w_scale, float* y,
               int ldy, bool prefetch) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  for (int kb = 0; kb < KB; ++kb) {
    const int8_t* at = A + (size_t)kb * 1024;
    const int8_t* bt = B + (size_t)kb * 1024;
    if (prefetch)
      for (int l = 0; l < 1024; l += 64) _mm_prefetch(reinterpret_cast<const char*>(bt + 2 * kPrefetchAhead + l), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int t = 0; t < 16; ++t) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bt + t * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bt + t * 64 + 32));
      const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);  // shared by the MR rows
      for (int i = 0; i < MR; ++i) {
        const __m256i a = bcast4(at + i * 64 + t * 4);
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(a, w0)), ones));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(a, w1)), ones));
      }
    }
  }
  const __m256 ws0 = _mm256_loadu_ps(w_scale), ws1 = _mm256_loadu_ps(w_scale + 8);
  for (int i = 0; i < MR; ++i) {
    const __m256 as = _mm256_set1_ps(a_scale[i]);
    _mm256_storeu_ps(y + (size_t)i * ldy, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][0]), as), ws0));
    _mm256_storeu_ps(y + (size_t)i * ldy + 8, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][1]), as), ws1));
  }
}

// MR activation rows × one 16-column block, int4 with grouped f16 scales.
// B: the strip's packed tiles (512 bytes each); scales: f16 row g at scales + g·N, already
// offset to this block's first column; rowsum: this row's [k/64] sums, row stride KB.
// Only the int16 accumulators live in registers through the inner loop (2·MR + 6 ymm); the
// int32 group sums and the f32 running sums are touched once per 8 tile rows / per group.
template <int MR>
void q4g_block(const int8_t* A, const uint8_t* B, int KB, int tiles_per_group, const uint16_t* scales, int N,
               const int32_t* rowsum, const float* a_scale, float* y, int ldy, bool prefetch) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x88));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  alignas(32) float s[MR][16];
  alignas(32) int32_t acc[MR][16];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 16; ++j) s[i][j] = 0.f;
  const int n_groups = KB / tiles_per_group;
  for (int g = 0; g < n_groups; ++g) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 16; ++j) acc[i][j] = 0;
    for (int kb = g * tiles_per_group; kb < (g + 1) * tiles_per_group; ++kb) {
      for (int half = 0; half < 2; ++half) {
        const int8_t* at = A + (size_t)kb * 1024 + half * 32;
        const uint8_t* bt = B + (size_t)kb * 512 + half * 256;
        __m256i a16[MR][2];
        for (int i = 0; i < MR; ++i) a16[i][0] = a16[i][1] = _mm256_setzero_si256();
        if (prefetch)
          for (int l = 0; l < 256; l += 64) _mm_prefetch(reinterpret_cast<const char*>(bt + kPrefetchAhead + l), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bt + t * 32)), flip);
          const __m256i wlo = _mm256_and_si256(v, low4);                         // columns 0..7, w + 8
          const __m256i whi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  // columns 8..15, w + 8
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const __m256i a = bcast4(at + i * 64 + t * 4);
            a16[i][0] = _mm256_add_epi16(a16[i][0], _mm256_maddubs_epi16(wlo, a));
            a16[i][1] = _mm256_add_epi16(a16[i][1], _mm256_maddubs_epi16(whi, a));
            // Pin the accumulators to registers: otherwise GCC reassociates the additions
            // and parks every product on the stack first.
            asm("" : "+x"(a16[i][0]), "+x"(a16[i][1]));
          }
        }
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < 2; ++j) {
            __m256i* p = reinterpret_cast<__m256i*>(&acc[i][8 * j]);
            _mm256_store_si256(p, _mm256_add_epi32(_mm256_load_si256(p), _mm256_madd_epi16(a16[i][j], ones)));
          }
      }
    }
    for (int j = 0; j < 2; ++j) {
      const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + (size_t)g * N + 8 * j)));
      for (int i = 0; i < MR; ++i) {
        int32_t gsum = 0;
        for (int kb = g * tiles_per_group; kb < (g + 1) * tiles_per_group; ++kb) gsum += rowsum[(size_t)i * KB + kb];
        const __m256i exact = _mm256_sub_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(&acc[i][8 * j])),
                                               _mm256_set1_epi32(8 * gsum));
        _mm256_store_ps(&s[i][8 * j], _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), sc, _mm256_load_ps(&s[i][8 * j])));
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    const __m256 as = _mm256_set1_ps(a_scale[i]);
    _mm256_storeu_ps(y + (size_t)i * ldy, _mm256_mul_ps(_mm256_load_ps(&s[i][0]), as));
    _mm256_storeu_ps(y + (size_t)i * ldy + 8, _mm256_mul_ps(_mm256_load_ps(&s[i][8]), as));
  }
}

constexpr int kMR = 4;  // rows per register block (divides 16)

template <int MR>
void run_block(const QAct& a, const QLinear& w, float* y, int ldy, int m, int nb) {
  const int KB = a.k / 64;
  const int mb = m / 16, r = m % 16;
  const bool prefetch = m == 0;  // the first row block streams the weights; later ones hit L2
  const int8_t* A = a.packed + ((size_t)mb * KB * 16 + r) * 64;
  float* yb = y + (size_t)m * ldy + nb * 16;
  if (w.dtype == DType::Q8C) {
    const int8_t* B = reinterpret_cast<const int8_t*>(w.codes) + (size_t)nb * KB * 1024;
    q8c_block<MR>(A, B, KB, a.scale + m, static_cast<const float*>(w.scales) + nb * 16, yb, ldy, prefetch);
  } else {
    const uint8_t* B = w.codes + (size_t)nb * KB * 512;
    q4g_block<MR>(A, B, KB, w.group / 64, static_cast<const uint16_t*>(w.scales) + nb * 16, w.n,
                  a.rowsum + (size_t)m * KB, a.scale + m, yb, ldy, prefetch);
  }
}

}  // namespace

void gemm_avx2(const QAct& a, const QLinear& w, float* y, int ldy, int nb0, int nb1) {
  // Rows in register blocks of kMR (never crossing a 16-row block), then the task's column
  // blocks: the task's B panel (≤ 4 strips) stays in L2, the kMR packed rows in L1.
  for (int m = 0; m < a.m; m += kMR) {
    const int mr = a.m - m < kMR ? a.m - m : kMR;
    for (int nb = nb0; nb < nb1; ++nb) {
      switch (mr) {
        case 4: run_block<4>(a, w, y, ldy, m, nb); break;
        case 3: run_block<3>(a, w, y, ldy, m, nb); break;
        case 2: run_block<2>(a, w, y, ldy, m, nb); break;
        default: run_block<1>(a, w, y, ldy, m, nb); break;
      }
    }
  }
}

uint64_t peak_loop_avx2(uint64_t iters) {
  // The u8×s8 multiply-add chain every AVX2 int8 dot product is built on: vpmaddubsw, then
  // vpmaddwd with ones and vpaddd; 8 independent accumulators hide the latency.
  __m256i u = _mm256_set1_epi8(3);
  const __m256i s = _mm256_set1_epi8(-5);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[8];
  for (auto& v : acc) v = _mm256_setzero_si256();
  for (uint64_t it = 0; it < iters; ++it) {
    for (auto& v : acc) {
      asm volatile("" : "+x"(u));  // an opaque operand: every product is really computed
      v = _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
    }
  }
  __m256i t = acc[0];
  for (int i = 1; i < 8; ++i) t = _mm256_add_epi32(t, acc[i]);
  volatile int32_t sink = _mm256_extract_epi32(t, 0);
  (void)sink;
  return iters * 8 * 32 * 2;
}

}  // namespace sg::detail
