// The q8g GEMM on AVX2 (docs/fgm-extensions.md), compiled with -mavx2 -mfma -mf16c: the AVX2 backend's kernels, and
// the int8 activations' quantiser of every backend.
//
// f32 activations (weight-only): one 16-byte row of a panel holds the codes of its 16 output columns at one k; they
// are widened to two ymm of f32 and each of MR activation rows adds x[m, k] · code to the group's partial sum with one
// FMA per column, k ascending; at the group's end acc = fma(partial, s[g], acc). That sequence per output is fixed
// by the format (gemm.h), not by the blocking, so every row count and thread count gives the same bits, and so does
// the AVX-512 kernel (gemm_q8g_avx512.cpp), whose lanes run the same sequences. A q8ga weight (with offsets) adds,
// after the groups, a second chain off = fma(Σx over group g, o[g], off) over g and then y = acc + off: outside the
// hot loop, whose registers it would otherwise crowd. int8 activations: q8g_int8_block below.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels_impl.h"
#include "q8g_driver.h"
#include "quotient_codes.h"

namespace sg::detail {
namespace {

// The f32-input kernels' register blocks: MR activation rows × NP panels (16 columns each) keep MR·NP·2 accumulators;
// with the two weight vectors and one broadcast that must fit the 16 ymm registers. Each accumulator is one FMA chain
// (k ascending, the format's order), so few rows need several panels in flight to hide the FMA latency: decode (1-3
// rows) is bound by that latency otherwise, prefill by the FMA ports. (The int8 kernels' blocks: kQ8gYmmRows.)
constexpr int kMaxRows = 6;

// 8 scales from s on, as f32 (f16 ones widened: exact).
inline __m256 load_scales8(Q8gScales s) {
  return s.f16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.p)))
               : _mm256_loadu_ps(static_cast<const float*>(s.p));
}

// y[i][16p .. 16p+15] += the offsets' chain of gemm.h (q8ga): off = fma(Σx over group g, o[g], off) over g, then one
// add; outside the kernels' hot loops, whose registers it would otherwise crowd.
template <int MR, int NP>
void add_offsets(const float* offsets, const float* xsum, int n_total, int k_total, int group, float* y, int ldy) {
  const int ng = k_total / group;
  __m256 off[MR][NP][2];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) off[i][p][0] = off[i][p][1] = _mm256_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    const float* o = offsets + size_t(g) * n_total;
    for (int p = 0; p < NP; ++p) {
      const __m256 o0 = _mm256_loadu_ps(o + 16 * p), o1 = _mm256_loadu_ps(o + 16 * p + 8);
      for (int i = 0; i < MR; ++i) {
        const __m256 xs = _mm256_broadcast_ss(xsum + size_t(i) * ng + g);
        off[i][p][0] = _mm256_fmadd_ps(xs, o0, off[i][p][0]);
        off[i][p][1] = _mm256_fmadd_ps(xs, o1, off[i][p][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) {
        float* yo = y + size_t(i) * ldy + 16 * p + 8 * h;
        _mm256_storeu_ps(yo, _mm256_add_ps(_mm256_loadu_ps(yo), off[i][p][h]));
      }
}

// Streaming, as the zmm kernel: the next panels' scales one block ahead, their codes as the driver shares them out
// (q8g_driver.h), trickled over the k steps. Zen 3, Gemma 3 270M decode B=1: the LM head 7.2-8.0 -> 5.9-6.5 ms a
// step (at the DRAM probe's rate), B=8 and B=32 ~6% faster.
template <int MR, int NP, bool OFF>
void q8g_block(const F32Rows& rows, const int8_t* codes, Q8gScales scales, const float* offsets,
               const float* xsum, int n_total, int k_total, int group, float* y, int ldy, const int8_t* pf,
               size_t pf_bytes) {
  const float* x = rows.x;
  const int ldx = rows.ldx;
  const size_t panel_bytes = size_t(k_total) * 16;
  PrefetchTrickle next(pf, pf_bytes, size_t(k_total));
  // acc is touched once per group (and spilled by the compiler when MR·NP is large); part is the hot FMA chain.
  __m256 acc[MR][NP][2];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) acc[i][p][0] = acc[i][p][1] = _mm256_setzero_ps();
  for (int k0 = 0; k0 < k_total; k0 += group) {
    __m256 part[MR][NP][2];
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) part[i][p][0] = part[i][p][1] = _mm256_setzero_ps();
    prefetch_next_scales<NP>(scales + size_t(k0 / group) * n_total);
    for (int k = k0; k < k0 + group; ++k) {
      next.step();
      for (int p = 0; p < NP; ++p) {
        const int8_t* c = codes + p * panel_bytes + size_t(k) * 16;
        const __m128i* lo = reinterpret_cast<const __m128i*>(c);      // columns 0-7 of the panel
        const __m128i* hi = reinterpret_cast<const __m128i*>(c + 8);  // columns 8-15
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(lo)));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(hi)));
        for (int i = 0; i < MR; ++i) {
          const __m256 a = _mm256_broadcast_ss(x + size_t(i) * ldx + k);
          part[i][p][0] = _mm256_fmadd_ps(a, w0, part[i][p][0]);
          part[i][p][1] = _mm256_fmadd_ps(a, w1, part[i][p][1]);
        }
      }
    }
    const Q8gScales s = scales + size_t(k0 / group) * n_total;
    for (int p = 0; p < NP; ++p) {
      const __m256 s0 = load_scales8(s + 16 * p), s1 = load_scales8(s + (16 * p + 8));
      for (int i = 0; i < MR; ++i) {
        acc[i][p][0] = _mm256_fmadd_ps(part[i][p][0], s0, acc[i][p][0]);
        acc[i][p][1] = _mm256_fmadd_ps(part[i][p][1], s1, acc[i][p][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) {
      _mm256_storeu_ps(y + size_t(i) * ldy + 16 * p, acc[i][p][0]);
      _mm256_storeu_ps(y + size_t(i) * ldy + 16 * p + 8, acc[i][p][1]);
    }
  if constexpr (OFF) add_offsets<MR, NP>(offsets, xsum, n_total, k_total, group, y, ldy);
}

// The int8-activation kernel (gemm.h, Q8gInput::Int8) on AVX2, which has no exact signed int8 dot product: the sign
// trick of the q8c kernel (gemm_avx2.cpp). vpmaddubsw multiplies |w| (unsigned, shared by the block's rows) by
// sign(a, w) (the code with w's sign), so each product is w·a and a pair's sum is at most 2·127·127 = 32258: never
// saturated; vpmaddwd with ones then adds a column's two pairs of a 4-input step into int32, exactly. The kernel wants
// a step's codes as two ymm of 8 columns × 4 codes. Read from the weight (TILED false), a step's 4 rows of 16 codes
// are transposed in registers into columns {0-3, 8-11} and {4-7, 12-15} (the byte and word unpacks work within
// 128-bit lanes): the sums and the stack tile keep that order, the scales are loaded in it, and y gets the columns
// back in order at the end. Read from the driver's scratch (TILED, repack_tiles below), they are in order already.
// Per unit (16 or 32 inputs) the exact sums are folded as the VNNI kernel folds them, y = fma((float)acc, a·s, y),
// so both give the same bits. That y is a tile on the stack until the end: y's rows at a multiple of 4 KB apart
// (N = 2048, 262144) alias each other's low address bits, and each unit's loads would wait on the other rows' stores
// (gemm_q8g_avx512.cpp, store_tile).
// NARROW (16 or 32), for a weight whose codes all lie within ±NARROW (QLinear::max_code): no sign trick. The
// weight's code + NARROW (0 .. 2·NARROW) is the unsigned operand and the activation code the signed one, so a pair's
// sum is at most 2·2·NARROW·127 and 64 / NARROW steps' pairs add up in int16 (4 steps at 16: 4·8128 = 32512 <
// 32767) before vpmaddwd folds them into int32; the unit's sum then drops NARROW·Σc (Q8gActs.bias = -128·Σc, so
// bias·NARROW/128, exactly). Per row and step two vpmaddubsw and two vpaddw in place of two vpsignb, two vpmaddubsw,
// two vpmaddwd and two vpaddd. The same exact sums, so the same bits.
// NARROW 15 (kQ8gNibbleCodes), for codes that all lie in 0..15 (Q4_K's and Q4_1's nibbles): the code itself is the
// unsigned operand, a pair is at most 2·15·127 = 3810, so a whole unit's steps (8 at most: 30480) add up in int16
// before one vpmaddwd, and there is nothing to drop.
template <int MR, int NP, bool OFF, int U, bool TILED, int NARROW>
void q8g_int8_block(const Int8Rows& rows, const int8_t* codes, Q8gScales scales, const float* offsets,
                    const float* xsum, int n_total, int k_total, int group, float* y, int ldy, const int8_t* pf,
                    size_t pf_bytes) {
  const size_t panel_bytes = size_t(k_total) * 16;
  const Q8gActs& a = *rows.a;
  const int8_t* xc = a.codes + size_t(rows.m0) * k_total;  // this block's codes: step k/4 at + (k/4)·4·MR
  const float* as = a.scale + rows.m0;                      // block b at + b·m
  const __m256i ones = _mm256_set1_epi16(1);
  PrefetchTrickle next(pf, pf_bytes, size_t(k_total / 4));
  alignas(32) float tile[MR][NP][16];  // columns in the order above
  constexpr bool kNibbles = NARROW == kQ8gNibbleCodes;
  constexpr int kFoldSteps = kNibbles ? U / 4 : NARROW ? 64 / NARROW : 1;  // steps whose pairs int16 holds
  static_assert((U / 4) % kFoldSteps == 0, "a unit is a whole number of folds");
  const __m256i code_offset = _mm256_set1_epi8(char(NARROW));
  const int32_t* bias = (U == 16 ? a.bias16 : a.bias32) + rows.m0;  // -128·Σc of unit u at + u·m
  alignas(32) __m256i part[MR][NP][2];  // NARROW: the int32 folds of a unit so far, past the first
  for (int k0 = 0, u = 0; k0 < k_total; k0 += U, ++u) {
    const Q8gScales s = scales + size_t(k0 / group) * n_total;
    if (k0 % group == 0) prefetch_next_scales<NP>(s);
    __m256i acc[MR][NP][2];
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) acc[i][p][0] = acc[i][p][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int kk = 0; kk < U; kk += 4) {
      const int k = k0 + kk;
      const int8_t* xk = xc + size_t(k / 4) * 4 * MR;
      next.step();
      __m256i w[NP][2], uw[NP][2];
      for (int p = 0; p < NP; ++p) {
        const int8_t* c = codes + p * panel_bytes + size_t(k) * 16;
        // Rows k, k+1 and k+2, k+3; TILED: columns 0-7 and 8-15, 4 codes each.
        const __m256i r01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
        const __m256i r23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
        if constexpr (TILED) {
          w[p][0] = r01;
          w[p][1] = r23;
        } else {
          const __m256i r02 = _mm256_permute2x128_si256(r01, r23, 0x20);
          const __m256i r13 = _mm256_permute2x128_si256(r01, r23, 0x31);
          const __m256i lo = _mm256_unpacklo_epi8(r02, r13), hi = _mm256_unpackhi_epi8(r02, r13);  // (k,k+1 | k+2,k+3)
          const __m256i p01 = _mm256_permute2x128_si256(lo, hi, 0x20), p23 = _mm256_permute2x128_si256(lo, hi, 0x31);
          w[p][0] = _mm256_unpacklo_epi16(p01, p23);  // columns 0-3 | 8-11, 4 codes each
          w[p][1] = _mm256_unpackhi_epi16(p01, p23);  // columns 4-7 | 12-15
        }
        for (int h = 0; h < 2; ++h)
          uw[p][h] = kNibbles ? w[p][h] : NARROW ? _mm256_add_epi8(w[p][h], code_offset) : _mm256_abs_epi8(w[p][h]);
      }
      for (int i = 0; i < MR; ++i) {
        int32_t quad;
        std::memcpy(&quad, xk + 4 * i, 4);
        const __m256i xb = _mm256_set1_epi32(quad);
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) {
            if constexpr (NARROW) {
              acc[i][p][h] = _mm256_add_epi16(acc[i][p][h], _mm256_maddubs_epi16(uw[p][h], xb));
            } else {
              const __m256i pairs = _mm256_maddubs_epi16(uw[p][h], _mm256_sign_epi8(xb, w[p][h]));
              acc[i][p][h] = _mm256_add_epi32(acc[i][p][h], _mm256_madd_epi16(pairs, ones));
            }
            // Pinned to its register: otherwise GCC adds the steps' products together first and parks the sums on
            // the stack (as in gemm_avx2.cpp's q4g kernel).
            asm("" : "+x"(acc[i][p][h]));
          }
      }
      if constexpr (NARROW) {
        // A fold after every kFoldSteps steps (kk is a constant once unrolled, so this is straight-line code): the
        // int16 pairs into int32, kept in `part` until the unit's last fold leaves the whole sum in acc.
        const int fold = kk / 4 / kFoldSteps, folds = U / 4 / kFoldSteps;
        if ((kk / 4 + 1) % kFoldSteps == 0)
          for (int i = 0; i < MR; ++i)
            for (int p = 0; p < NP; ++p)
              for (int h = 0; h < 2; ++h) {
                const __m256i s32 = _mm256_madd_epi16(acc[i][p][h], ones);
                if (fold + 1 == folds) {
                  acc[i][p][h] = fold == 0 ? s32 : _mm256_add_epi32(s32, part[i][p][h]);
                } else {
                  part[i][p][h] = fold == 0 ? s32 : _mm256_add_epi32(s32, part[i][p][h]);
                  acc[i][p][h] = _mm256_setzero_si256();
                }
              }
      }
    }
    if constexpr (NARROW && !kNibbles)
      for (int i = 0; i < MR; ++i) {
        const __m256i drop = _mm256_set1_epi32(bias[size_t(u) * a.m + i] / (128 / NARROW));
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) acc[i][p][h] = _mm256_add_epi32(acc[i][p][h], drop);
      }
    for (int p = 0; p < NP; ++p) {
      const __m256 s0 = load_scales8(s + 16 * p), s1 = load_scales8(s + (16 * p + 8));
      const __m256 sv[2] = {TILED ? s0 : _mm256_permute2f128_ps(s0, s1, 0x20),
                            TILED ? s1 : _mm256_permute2f128_ps(s0, s1, 0x31)};
      for (int i = 0; i < MR; ++i) {
        const __m256 ai = _mm256_broadcast_ss(as + size_t(k0 / 32) * a.m + i);
        for (int h = 0; h < 2; ++h) {
          float* t = tile[i][p] + 8 * h;
          const __m256 prev = u == 0 ? _mm256_setzero_ps() : _mm256_load_ps(t);
          _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][p][h]), _mm256_mul_ps(sv[h], ai), prev));
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) {
      const __m256 t0 = _mm256_load_ps(tile[i][p]), t1 = _mm256_load_ps(tile[i][p] + 8);
      _mm256_storeu_ps(y + size_t(i) * ldy + 16 * p, TILED ? t0 : _mm256_permute2f128_ps(t0, t1, 0x20));
      _mm256_storeu_ps(y + size_t(i) * ldy + 16 * p + 8, TILED ? t1 : _mm256_permute2f128_ps(t0, t1, 0x31));
    }
  if constexpr (OFF) add_offsets<MR, NP>(offsets, xsum, n_total, k_total, group, y, ldy);
}

// Panels per block for MR rows, and the kernels for each MR with that many and with one panel (the remainder of a
// panel range). Measured on Zen 3 (bench/bench_gemm.py, LM head N=262144 at M=1): 3 panels for one row beat 1 (too
// few FMA chains) and 6 (spills, and six weight streams at once); 2 for two rows.
constexpr int kPanelsFor[kMaxRows + 1] = {0, 3, 2, 1, 1, 1, 1};
// The int8 kernel holds MR·NP·2 int32 sums, NP·2 weight vectors signed and unsigned, a broadcast and the ones: one
// row takes 2 panels within the 16 ymm.
constexpr int kPanelsForInt8[kQ8gYmmRows + 1] = {0, 2, 1, 1, 1};
template <bool OFF>
constexpr Q8gBlockFn<F32Rows> kWide[kMaxRows + 1] = {nullptr,
                                                     q8g_block<1, 3, OFF>, q8g_block<2, 2, OFF>, q8g_block<3, 1, OFF>,
                                                     q8g_block<4, 1, OFF>, q8g_block<5, 1, OFF>, q8g_block<6, 1, OFF>};
template <bool OFF>
constexpr Q8gBlockFn<F32Rows> kOne[kMaxRows + 1] = {nullptr,
                                                    q8g_block<1, 1, OFF>, q8g_block<2, 1, OFF>, q8g_block<3, 1, OFF>,
                                                    q8g_block<4, 1, OFF>, q8g_block<5, 1, OFF>, q8g_block<6, 1, OFF>};
template <bool OFF, int U, bool TILED, int NARROW>
constexpr Q8gBlockFn<Int8Rows> kWideInt8[kQ8gYmmRows + 1] = {
    nullptr, q8g_int8_block<1, 2, OFF, U, TILED, NARROW>, q8g_int8_block<2, 1, OFF, U, TILED, NARROW>,
    q8g_int8_block<3, 1, OFF, U, TILED, NARROW>, q8g_int8_block<4, 1, OFF, U, TILED, NARROW>};
template <bool OFF, int U, bool TILED, int NARROW>
constexpr Q8gBlockFn<Int8Rows> kOneInt8[kQ8gYmmRows + 1] = {
    nullptr, q8g_int8_block<1, 1, OFF, U, TILED, NARROW>, q8g_int8_block<2, 1, OFF, U, TILED, NARROW>,
    q8g_int8_block<3, 1, OFF, U, TILED, NARROW>, q8g_int8_block<4, 1, OFF, U, TILED, NARROW>};

// Several row blocks (a decode batch past kQ8gYmmRows rows, a prefill chunk) would each transpose the same panels:
// the driver has each panel block rewritten once into its scratch (q8g_driver.h), a 4-input step's 64 bytes as
// [columns 0-7 × 4 codes][columns 8-15 × 4 codes], which the TILED kernels read as they are. Gemma 3 270M's shapes
// (LM head N=262144 K=640, N=2048 K=640, N=640 K=2048), 2 threads, processes alternated on Zen 3: 5-8 rows took
// 0.58-0.80x the time of the same 4-row blocks each transposing for itself; 8-32 rows 0.67-0.75x that of the 6-row
// blocks before (which spilled sums). One block (2-4 rows) reads the weight as it is: the rewrite took 1.2-1.4x the
// time on the LM head from DRAM (0.97-1.08x on the small shapes).
void repack_tiles(const int8_t* codes, size_t bytes, int8_t* out) {
  for (size_t o = 0; o < bytes; o += 64) {
    const __m128i* in = reinterpret_cast<const __m128i*>(codes + o);
    const __m128i r0 = _mm_loadu_si128(in), r1 = _mm_loadu_si128(in + 1);  // inputs k, k+1: 16 columns each
    const __m128i r2 = _mm_loadu_si128(in + 2), r3 = _mm_loadu_si128(in + 3);
    const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);  // columns 0-7, 8-15: (k, k+1)
    const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
    __m128i* t = reinterpret_cast<__m128i*>(out + o);
    _mm_store_si128(t, _mm_unpacklo_epi16(lo01, lo23));      // columns 0-3, 4 codes each
    _mm_store_si128(t + 1, _mm_unpackhi_epi16(lo01, lo23));  // 4-7
    _mm_store_si128(t + 2, _mm_unpacklo_epi16(hi01, hi23));  // 8-11
    _mm_store_si128(t + 3, _mm_unpackhi_epi16(hi01, hi23));  // 12-15
  }
}

}  // namespace

void q8g_group_sums(const float* x, int ldx, int m, int k, int group, float* xs) {
  // gemm.h's order: eight lanes t[j] = Σ_i x[8i + j] over the group's first 8·⌊G/8⌋ values (i ascending, from +0),
  // then ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)), then the last G mod 8 values one by one.
  const int ng = k / group, full = group / 8 * 8;
  for (int i = 0; i < m; ++i)
    for (int g = 0; g < ng; ++g) {
      const float* r = x + size_t(i) * ldx + size_t(g) * group;
      __m256 t = _mm256_setzero_ps();
      for (int j = 0; j < full; j += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(r + j));
      alignas(32) float l[8];
      _mm256_store_ps(l, t);
      float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
      for (int j = full; j < group; ++j) s += r[j];
      xs[size_t(i) * ng + g] = s;
    }
}

void gemm_q8g_panels(const float* x, int ldx, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0,
                     int p1) {
  constexpr int kPanelBlock = 6;  // 6 panels of K=2048: 192 KB of codes, within Zen 3's 512 KB L2
  q8g_drive(Q8gKernels<F32Rows>{kMaxRows, kPanelBlock, kPanelsFor,
                                {kWide<false>, kOne<false>, kWide<true>, kOne<true>}},
            F32Rows{x, ldx}, m, w, xsum, y, ldy, p0, p1);
}

namespace {
template <int U, bool TILED, int NARROW>
constexpr Q8gFns<Int8Rows> kInt8{kWideInt8<false, U, TILED, NARROW>, kOneInt8<false, U, TILED, NARROW>,
                                 kWideInt8<true, U, TILED, NARROW>, kOneInt8<true, U, TILED, NARROW>};

template <int U, int NARROW>
void int8_panels(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0, int p1) {
  constexpr int kPanelBlock = 6;
  if (m > kQ8gYmmRows)
    q8g_drive(Q8gKernels<Int8Rows>{kQ8gYmmRows, kPanelBlock, kPanelsForInt8, kInt8<U, true, NARROW>, repack_tiles},
              Int8Rows{&a, 0}, m, w, xsum, y, ldy, p0, p1);
  else
    q8g_drive(Q8gKernels<Int8Rows>{kQ8gYmmRows, kPanelBlock, kPanelsForInt8, kInt8<U, false, NARROW>},
              Int8Rows{&a, 0}, m, w, xsum, y, ldy, p0, p1);
}

template <int U>
void int8_panels_for(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0,
                     int p1) {
  if (w.max_code == kQ8gNibbleCodes) int8_panels<U, kQ8gNibbleCodes>(a, m, w, xsum, y, ldy, p0, p1);
  else if (w.max_code <= 16) int8_panels<U, 16>(a, m, w, xsum, y, ldy, p0, p1);
  else if (w.max_code <= 32) int8_panels<U, 32>(a, m, w, xsum, y, ldy, p0, p1);
  else int8_panels<U, 0>(a, m, w, xsum, y, ldy, p0, p1);
}
}  // namespace

void gemm_q8g_int8_panels(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0,
                          int p1) {
  if (w.group == 16) int8_panels_for<16>(a, m, w, xsum, y, ldy, p0, p1);
  else int8_panels_for<32>(a, m, w, xsum, y, ldy, p0, p1);
}

void q8g_quantize_rows(const float* x, int ldx, int r0, int r1, const Q8gActs& a) {
  // gemm.h: per 32 inputs a = amax / 127 (1 when amax = 0), code = clamp(round_half_even(x / a), ±127): the f32
  // division's integers, as in quantize_activations (quotient_codes.h).
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lane interleave, undone
  const int m = a.m, k = a.k, kb = k / 32, R = a.block_rows;
  auto lane_sum = [](__m256i v) {
    alignas(32) int32_t l[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(l), v);
    return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
  };
  for (int i = r0; i < r1; ++i) {
    const int b0 = i / R * R, r = std::min(R, m - b0), ib = i - b0;  // its register block: first row, rows, index
    int8_t* const crow = a.codes + size_t(b0) * k + 4 * ib;           // + (k/4)·4r
    for (int b = 0; b < kb; ++b) {
      const float* v = x + size_t(i) * ldx + 32 * b;
      __m256 f[4];
      for (int j = 0; j < 4; ++j) f[j] = _mm256_loadu_ps(v + 8 * j);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(f[0], magnitude), _mm256_and_ps(f[1], magnitude)),
                                _mm256_max_ps(_mm256_and_ps(f[2], magnitude), _mm256_and_ps(f[3], magnitude)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float s = amax > 0.f ? amax / 127.0f : 1.0f;
      a.scale[size_t(b) * m + i] = s;
      const QuotientCodes256 codes(s);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) q[j] = _mm256_min_epi32(_mm256_max_epi32(codes(f[j]), lo), hi);
      alignas(32) int8_t c[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(c),
                         _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                                        _mm256_packs_epi32(q[2], q[3])),
                                                     order));
      for (int j = 0; j < 8; ++j)  // codes 32b + 4j .. +3: step 8b + j
        std::memcpy(crow + size_t(8 * b + j) * 4 * r, c + 4 * j, 4);
      const int32_t s0 = lane_sum(_mm256_add_epi32(q[0], q[1])), s1 = lane_sum(_mm256_add_epi32(q[2], q[3]));
      a.bias16[size_t(2 * b) * m + i] = -128 * s0;
      a.bias16[size_t(2 * b + 1) * m + i] = -128 * s1;
      a.bias32[size_t(b) * m + i] = -128 * (s0 + s1);
    }
  }
}

}  // namespace sg::detail
