// The AVX-512 VNNI backend (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -O3;
// called only when CPUID says so).
//
// One 64-byte tile row of the weight file is exactly one zmm of vpdpbusd's B operand: lane n
// holds 4 consecutive k of column n. vpdpbusd multiplies UNSIGNED bytes by SIGNED bytes, so the
// weight side is made unsigned by a bias and the activation side stays signed:
//   q8c: w + 128 (xor 0x80);   q4g: w + 8 ((v xor 8) of the two's-complement nibble).
// Σ(w + b)·a = Σ w·a + b·Σa, and Σa per row per 64-block is QAct.rowsum, so subtracting
// b·Σa gives the exact int32 sum (|Σ| ≤ K·255·127 fits int32 for K ≤ 66048). The float
// epilogue is the one specified in gemm.h, so results are bit-identical to the other backends.
//
// Up to 8 rows (decode at small batches: bound by reading the weights): one pass over the task's
// column blocks with a register block of 1, 2, 4 or 8 rows × 2 column blocks (32 columns); A is
// broadcast one 4-byte group at a time from the shared packed layout. The packed rows are
// padded to 16 (gemm.h), so rounding a row count up to a power of two only computes padding rows,
// which are never stored; prefill chunks (more than kPanelMaxRows rows) run the same blocks 8
// rows at a time. Decode batches of 9..kPanelMaxRows rows: panels of 32 rows over k-chunks
// (see panel() below).
#include <immintrin.h>

#include <cstring>

#include "kernels_impl.h"
#include "line_prefetch.h"

namespace sg::detail {
namespace {

// Weight strips are read kPrefetchBytes ahead with prefetcht0. The hardware prefetcher stops at every 4 KB page,
// and a decode GEMM streams short strips (one 16-column block: K/2 bytes of int4 per 16 rows) from DRAM, so without
// it each page starts cold. Measured on the 2-core Zen 5 host (bench/bench_gemm.py's shape N=6144, K=1536, q4g,
// 2 threads, shared machine, two alternated rounds): M=1 from 10-15 GB/s to 22-26 GB/s, M=8 from 7-8 to 9-12
// GB/s; distances of 2-16 KB were alike, 4 KB among the best for both. Past the strip's end the address is the next
// strip's (adjacent in the file), which this or the other thread reads next; a prefetch never faults.
constexpr int kPrefetchBytes = 4096;
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Tile row t of an int8 strip as unsigned w + 128.
inline __m512i b_q8(const int8_t* bt, int t) {
  return _mm512_xor_si512(_mm512_loadu_si512(bt + t * 64), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Tile row t of an int4 strip (32 packed bytes) as unsigned w + 8: low nibbles are columns
// 0..7 (bytes 0..31 of the zmm), high nibbles columns 8..15 (bytes 32..63). The 32 bytes are
// broadcast to both halves and only the upper half is shifted down by 4.
inline __m512i b_q4(const uint8_t* bt, int t) {
  const __m512i v = _mm512_xor_si512(
      _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bt + t * 32))),
      _mm512_set1_epi8(static_cast<char>(0x88)));
  return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), _mm512_set1_epi8(0x0F));
}

struct Ctx {
  const QAct* a;
  const QLinear* w;
  float* y;
  int ldy;
  int KB;
  bool stream;  // stream_output(): a large output, written with streaming stores
};

// The q4g scales of the NB column blocks after nb (NB·16 f16 per group, one row of n per group): a pattern the
// hardware prefetchers do not follow, so without this each group's epilogue waited on DRAM. bench/ab_gemm_vnni (Zen 5,
// in one process, alternated call by call): 0.81-0.96x the time at 4 and 8 rows (the LM head at 8 rows 0.82-0.83x),
// 0.89-0.97x at 16-32 rows, 0.96-0.99x at one row.
template <int NB>
inline void prefetch_next_scales(const Ctx& c, int nb, int groups) {
  const uint16_t* next = static_cast<const uint16_t*>(c.w->scales) + (size_t)(nb + NB) * 16;
  for (int g = 0; g < groups; ++g)
    for (int e = 0; e < NB * 16; e += 32) prefetch(next + (size_t)g * c.w->n + e);  // 32 f16 a line
}

// The q8c epilogue of rows m .. m + valid − 1 once the whole K is summed: y = ((acc − 128·Σa) · a_scale) · w_scale.
template <int MR, int NB>
inline void store_q8(const Ctx& c, int m, int valid, int nb, const __m512i (&acc)[MR][NB]) {
  const int KB = c.KB;
  const float* ws = static_cast<const float*>(c.w->scales) + nb * 16;
  for (int i = 0; i < MR && i < valid; ++i) {
    int32_t total = 0;
    for (int kb = 0; kb < KB; ++kb) total += c.a->rowsum[(size_t)(m + i) * KB + kb];
    const __m512i corr = _mm512_set1_epi32(128 * total);
    const __m512 as = _mm512_set1_ps(c.a->scale[m + i]);
    float* yr = c.y + (size_t)(m + i) * c.ldy + nb * 16;
    for (int j = 0; j < NB; ++j) {
      const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], corr));
      store_out(yr + j * 16, _mm512_mul_ps(_mm512_mul_ps(f, as), _mm512_loadu_ps(ws + j * 16)), c.stream);
    }
  }
}

// MR rows starting at row m (MR | 16, m % MR == 0 … m + MR within one 16-row block), NB column
// blocks starting at nb; rows >= valid are padding and not stored.
template <int MR, int NB>
void block_q8(const Ctx& c, int m, int valid, int nb) {
  const int KB = c.KB;
  const int8_t* A = c.a->packed + ((size_t)(m / 16) * KB * 16 + m % 16) * 64;
  const int8_t* B = reinterpret_cast<const int8_t*>(c.w->codes) + (size_t)nb * KB * 1024;
  const size_t bstride = (size_t)KB * 1024;
  __m512i acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int kb = 0; kb < KB; ++kb) {
    const int8_t* at = A + (size_t)kb * 1024;
    const int8_t* bt = B + (size_t)kb * 1024;
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      for (int j = 0; j < NB; ++j) prefetch(bt + j * bstride + kPrefetchBytes + t * 64);
      __m512i b[NB];
      for (int j = 0; j < NB; ++j) b[j] = b_q8(bt + j * bstride, t);
      for (int i = 0; i < MR; ++i) {
        const __m512i av = bcast4(at + i * 64 + t * 4);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], b[j], av);
      }
    }
  }
  store_q8<MR, NB>(c, m, valid, nb, acc);
}

// A q4g register block's operands: k-blocks per scale group, the activation rows from row m, the strips from column
// block nb (bstride apart) and their scales.
struct Q4Operands {
  int KB, TG;
  const int8_t* A;
  const uint8_t* B;
  size_t bstride;
  const uint16_t* scales;
};
inline Q4Operands q4_operands(const Ctx& c, int m, int nb) {
  return {c.KB, c.w->group / 64, c.a->packed + ((size_t)(m / 16) * c.KB * 16 + m % 16) * 64,
          c.w->codes + (size_t)nb * c.KB * 512, (size_t)c.KB * 512,
          static_cast<const uint16_t*>(c.w->scales) + nb * 16};
}

// The line kPrefetchBytes ahead of tile row t of k-block kb in each of a block's NB q4g strips (bt: the k-block's row
// in strip 0). Near a strip's end that line is in the next column blocks' strip j (NB strips on), which this thread
// reads next when its task goes on, rather than in this block's next strip, read now.
template <int NB>
inline void prefetch_q4_line(const uint8_t* bt, size_t bstride, int kb, int t) {
  const size_t ahead = (size_t)kb * 512 + t * 32 + kPrefetchBytes;
  const size_t skip = ahead < bstride ? 0 : (NB - 1) * bstride;
  for (int j = 0; j < NB; ++j) prefetch(bt + j * bstride + kPrefetchBytes + t * 32 + skip);
}

template <int MR, int NB>
void block_q4(const Ctx& c, int m, int valid, int nb) {
  const auto [KB, TG, A, B, bstride, scales] = q4_operands(c, m, nb);
  prefetch_next_scales<NB>(c, nb, KB / TG);
  __m512 s[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) s[i][j] = _mm512_setzero_ps();
  for (int g = 0; g < KB / TG; ++g) {
    __m512i acc[MR][NB];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int kb = g * TG; kb < (g + 1) * TG; ++kb) {
      const int8_t* at = A + (size_t)kb * 1024;
      const uint8_t* bt = B + (size_t)kb * 512;
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) {
        if (t % 2 == 0) prefetch_q4_line<NB>(bt, bstride, kb, t);  // one 64-byte line of each strip per two tile rows
        __m512i b[NB];
        for (int j = 0; j < NB; ++j) b[j] = b_q4(bt + j * bstride, t);
        for (int i = 0; i < MR; ++i) {
          const __m512i av = bcast4(at + i * 64 + t * 4);
          for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], b[j], av);
        }
      }
    }
    __m512 sc[NB];
    for (int j = 0; j < NB; ++j)
      sc[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (size_t)g * c.w->n + j * 16)));
    for (int i = 0; i < MR; ++i) {
      int32_t gsum = 0;
      for (int kb = g * TG; kb < (g + 1) * TG; ++kb) gsum += c.a->rowsum[(size_t)(m + i) * KB + kb];
      const __m512i corr = _mm512_set1_epi32(8 * gsum);
      for (int j = 0; j < NB; ++j)
        s[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], corr)), sc[j], s[i][j]);
    }
  }
  for (int i = 0; i < MR && i < valid; ++i) {
    const __m512 as = _mm512_set1_ps(c.a->scale[m + i]);
    float* yr = c.y + (size_t)(m + i) * c.ldy + nb * 16;
    for (int j = 0; j < NB; ++j) store_out(yr + j * 16, _mm512_mul_ps(s[i][j], as), c.stream);
  }
}

// One int4 row (single-stream decode): block_q4's sums with two tile rows to a vpdpbusd. A 64-byte load holds tile
// rows t and t+1 of a strip (32 bytes each); its low nibbles are columns 0..7 at both (dword lanes 0..7 at t, 8..15 at
// t+1), its high nibbles columns 8..15, and one broadcast gives lanes 0..7 row t's activations and lanes 8..15 row
// t+1's. So a 64-byte line costs 3 vector operations and 2 vpdpbusd (block_q4: 6 and 2), and each sum's chain is half
// as long; the halves are added once per scale group. The int32 sums are the same integers (exact), so the same bits.
// On a Xeon with AMX (docs/benchmarks.md, session 41) a core ran 44 GB/s of weights from L2 with it against block_q4's
// 39; from DRAM the gain shows only with more strips at once (rows<1>): NB strips are NB streams, 12 KB apart at K=1536.
// kHalves: dword 0 of the broadcast pair to lanes 0..7, dword 1 to lanes 8..15.
alignas(64) constexpr int32_t kHalves[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
template <int NB>
void block_q4_row(const Ctx& c, int m, int valid, int nb) {
  const auto [KB, TG, A, B, bstride, scales] = q4_operands(c, m, nb);
  prefetch_next_scales<NB>(c, nb, KB / TG);
  const __m512i c88 = _mm512_set1_epi8(static_cast<char>(0x88)), c08 = _mm512_set1_epi8(0x08),
                c0f = _mm512_set1_epi8(0x0F);
  const __m512i halves = _mm512_loadu_si512(kHalves);
  __m512 s[NB];
  for (int j = 0; j < NB; ++j) s[j] = _mm512_setzero_ps();
  for (int g = 0; g < KB / TG; ++g) {
    __m512i lo[NB], hi[NB];
    for (int j = 0; j < NB; ++j) lo[j] = hi[j] = _mm512_setzero_si512();
    for (int kb = g * TG; kb < (g + 1) * TG; ++kb) {
      const int8_t* at = A + (size_t)kb * 1024;
      const uint8_t* bt = B + (size_t)kb * 512;
#pragma GCC unroll 8
      for (int t = 0; t < 16; t += 2) {
        prefetch_q4_line<NB>(bt, bstride, kb, t);
        int64_t quads;
        std::memcpy(&quads, at + t * 4, 8);
        const __m512i av = _mm512_permutexvar_epi32(halves, _mm512_set1_epi64(quads));
        for (int j = 0; j < NB; ++j) {
          const __m512i v = _mm512_loadu_si512(bt + j * bstride + t * 32);
          // (v ^ 0x88) & 0x0F: the low nibbles as w + 8; the high ones shifted down, then (x ^ 0x08) & 0x0F.
          lo[j] = _mm512_dpbusd_epi32(lo[j], _mm512_ternarylogic_epi32(v, c88, c0f, 0x28), av);
          hi[j] = _mm512_dpbusd_epi32(hi[j], _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), c08, c0f, 0x28), av);
        }
      }
    }
    int32_t gsum = 0;
    for (int kb = g * TG; kb < (g + 1) * TG; ++kb) gsum += c.a->rowsum[(size_t)m * KB + kb];
    const __m512i corr = _mm512_set1_epi32(8 * gsum);
    for (int j = 0; j < NB; ++j) {
      // Columns 0..7 are lo's two halves, 8..15 hi's.
      const __m512i sum = _mm512_add_epi32(_mm512_shuffle_i64x2(lo[j], hi[j], 0x44), _mm512_shuffle_i64x2(lo[j], hi[j], 0xEE));
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (size_t)g * c.w->n + j * 16)));
      s[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, corr)), sc, s[j]);
    }
  }
  if (valid < 1) return;
  const __m512 as = _mm512_set1_ps(c.a->scale[m]);
  float* yr = c.y + (size_t)m * c.ldy + nb * 16;
  for (int j = 0; j < NB; ++j) store_out(yr + j * 16, _mm512_mul_ps(s[j], as), c.stream);
}

template <int MR>
void rows(const Ctx& c, int m, int valid, int nb0, int nb1) {
  const bool q8 = c.w->dtype == DType::Q8C;
  int nb = nb0;
  if constexpr (MR == 1) {
    // One int4 row (single-stream decode) on AMD reads one strip at a time: a single stream per thread, which both
    // threads together pull from DRAM faster than two interleaved ones each. Measured on Zen 5 (bench/ab_gemm_vnni, in
    // one process, alternated call by call): 0.87-0.94x the time of two strips at N=6144 K=1536, N=1536 K=6144 and
    // N=2048 K=1536; at 2-8 rows it did not pay in the model (B=4, B=8 slower), and q8c was unchanged. On Intel the
    // opposite, and more strips stream faster still: a Xeon with AMX streamed 14.9-15.2 GB/s one strip at a time and
    // 23.1-23.6 two at a time (session 19). E2B's single-stream decode step there (session 41, alternated processes,
    // 3 rounds a pair): block_q4 on two strips 57.2-60.2 ms, on four 53.9-56.9; block_q4_row on two 56.8-59.6, on four
    // 52.5-54.4, on eight 51.2-54.2 (its FFN 28.4-30.0 ms for 791 MB: 26-28 GB/s). q8c on four strips: no change.
    if (!q8 && cpu_is_amd()) {
      for (; nb < nb1; ++nb) block_q4_row<1>(c, m, valid, nb);
      return;
    }
    if (!q8) {
      for (; nb + 8 <= nb1; nb += 8) block_q4_row<8>(c, m, valid, nb);
      for (; nb + 4 <= nb1; nb += 4) block_q4_row<4>(c, m, valid, nb);
      for (; nb + 2 <= nb1; nb += 2) block_q4_row<2>(c, m, valid, nb);
      if (nb < nb1) block_q4_row<1>(c, m, valid, nb);
      return;
    }
  }
  for (; nb + 2 <= nb1; nb += 2) q8 ? block_q8<MR, 2>(c, m, valid, nb) : block_q4<MR, 2>(c, m, valid, nb);
  if (nb < nb1) q8 ? block_q8<MR, 1>(c, m, valid, nb) : block_q4<MR, 1>(c, m, valid, nb);
}


// Taller calls (8 < M <= kPanelMaxRows: decode batches). The blocks above stream a task's weights once per 8 rows, so
// at M = 32 the first of four passes reads DRAM in a burst with little arithmetic to hide it, and the other three
// re-read L2. Here a set of column blocks is walked in chunks of up to kChunkTiles 64-deep k-blocks (never across a
// q4g scale group), and every row block of a panel of up to kPanelRows rows runs over the chunk while it is in L1;
// the int32 partial sums (exact, so the split changes no bit) and the q4g float sums wait in a small buffer between
// chunks. The next chunk's lines are prefetched one per tile row, spread over the current chunk's arithmetic, so
// DRAM is read at an even pace. An int4 chunk is unpacked once into int8 (w + 8) scratch that every row block reads.
// The register block is 4 rows × 4 column blocks (16 accumulators): 4 broadcasts and 4 weight loads per 16
// vpdpbusd; 8 × 2 (10 loads) measured 0.86–0.9x as fast at M = 32 (N=6144, K=1536, int8 and int4, 2 threads,
// alternated on the shared host).
constexpr int kChunkTiles = 4;
constexpr int kPanelRows = 32;
// Up to this many rows (decode batches). Prefill chunks keep the 8-row blocks: at M = 256 (N=6144 and K=1536, or
// N=1536 and K=6144, int8) the panels took 1.18x and 1.28x as long, at M = 128 1.02x, at M = 64 0.75x (alternated
// call by call, 2 threads, load 9).
constexpr int kPanelMaxRows = 64;

// acc[i][j] += rows i of A · strip j over k-blocks [k0, k1); load_b(j, kb, t) gives the unsigned weight tile row.
// The accumulators and the prefetch cursor are copied into locals first: __m512i is a may_alias type, so while the
// loop wrote the caller's cursor through a reference GCC had to keep the caller's accumulators in memory, and it
// reloaded and stored them around every 16 tile rows. bench/ab_gemm_vnni (Zen 5, M = 32, N=1536 and 6144, K=1536,
// q8c and q4g, alternated call by call): 0.93-0.95x the time, weights cached or streamed.
template <int MR, int NB, class LoadB>
inline void dot(const int8_t* A, int k0, int k1, __m512i (&acc_io)[MR][NB], LinePrefetch& pf_io, LoadB&& load_b) {
  __m512i acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = acc_io[i][j];
  LinePrefetch pf = pf_io;
  for (int kb = k0; kb < k1; ++kb) {
    const int8_t* at = A + (size_t)kb * 1024;
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      pf.step();
      __m512i b[NB];
      for (int j = 0; j < NB; ++j) b[j] = load_b(j, kb, t);
      for (int i = 0; i < MR; ++i) {
        const __m512i av = bcast4(at + i * 64 + t * 4);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], b[j], av);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc_io[i][j] = acc[i][j];
  pf_io = pf;
}

// Rows [m0, m0 + rows) (m0 % 16 == 0, rows <= kPanelRows) of column blocks nb .. nb + NB - 1.
template <int MR, int NB>
void panel(const Ctx& c, int m0, int rows, int nb) {
  const int KB = c.KB;
  const bool q8 = c.w->dtype == DType::Q8C;
  const int TG = q8 ? KB : c.w->group / 64;  // k-blocks per scale group (q8c: one group, the whole K)
  const size_t kb_bytes = q8 ? 1024 : 512;   // one k-block of one strip
  const size_t bstride = (size_t)KB * kb_bytes;
  const uint8_t* B = c.w->codes + (size_t)nb * bstride;
  const int nrb = (rows + MR - 1) / MR;
  alignas(64) int32_t ibuf[kPanelRows / MR][MR][NB][16];
  alignas(64) float fbuf[kPanelRows / MR][MR][NB][16];
  alignas(64) uint8_t scratch[NB][kChunkTiles * 16][64];
  if (!q8) prefetch_next_scales<NB>(c, nb, KB / TG);
  for (int g = 0; g < KB / TG; ++g) {
    for (int k0 = g * TG; k0 < (g + 1) * TG; k0 += kChunkTiles) {
      const int k1 = k0 + kChunkTiles < (g + 1) * TG ? k0 + kChunkTiles : (g + 1) * TG;
      const bool first = k0 == g * TG, last = k1 == (g + 1) * TG;
      // The chunk after this one (NB strips, one line per tile row of the arithmetic): the same strips further on,
      // or after the last chunk the next column blocks'.
      LinePrefetch pf{k1 < KB ? B + k1 * kb_bytes : B + NB * bstride, bstride,
                      int((k1 < KB ? (KB - k1 < kChunkTiles ? KB - k1 : kChunkTiles) : kChunkTiles) * kb_bytes / 64),
                      NB};
      if (!q8)
        for (int j = 0; j < NB; ++j)
          for (int kb = k0; kb < k1; ++kb)
            for (int t = 0; t < 16; ++t)
              _mm512_store_si512(scratch[j][(kb - k0) * 16 + t], b_q4(B + j * bstride + (size_t)kb * 512, t));
      for (int rb = 0; rb < nrb; ++rb) {
        const int m = m0 + rb * MR;
        __m512i acc[MR][NB];
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NB; ++j) acc[i][j] = first ? _mm512_setzero_si512() : _mm512_load_si512(ibuf[rb][i][j]);
        const int8_t* A = c.a->packed + ((size_t)(m / 16) * KB * 16 + m % 16) * 64;
        if (q8)
          dot<MR, NB>(A, k0, k1, acc, pf, [&](int j, int kb, int t) {
            return b_q8(reinterpret_cast<const int8_t*>(B + j * bstride + (size_t)kb * 1024), t);
          });
        else
          dot<MR, NB>(A, k0, k1, acc, pf,
                      [&](int j, int kb, int t) { return _mm512_load_si512(scratch[j][(kb - k0) * 16 + t]); });
        if (!last) {
          for (int i = 0; i < MR; ++i)
            for (int j = 0; j < NB; ++j) _mm512_store_si512(ibuf[rb][i][j], acc[i][j]);
          continue;
        }
        const int valid = rows - rb * MR < MR ? rows - rb * MR : MR;
        if (q8) {  // the whole K is done
          store_q8<MR, NB>(c, m, valid, nb, acc);
          continue;
        }
        // q4g: fold group g into the float sums, in group order; after the last group, y = s · a_scale.
        const uint16_t* scales = static_cast<const uint16_t*>(c.w->scales) + nb * 16 + (size_t)g * c.w->n;
        __m512 sc[NB];
        for (int j = 0; j < NB; ++j)
          sc[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + j * 16)));
        for (int i = 0; i < MR; ++i) {
          int32_t gsum = 0;
          for (int kb = g * TG; kb < (g + 1) * TG; ++kb) gsum += c.a->rowsum[(size_t)(m + i) * KB + kb];
          const __m512i corr = _mm512_set1_epi32(8 * gsum);
          for (int j = 0; j < NB; ++j) {
            const __m512 s = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(fbuf[rb][i][j]);
            _mm512_store_ps(fbuf[rb][i][j],
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], corr)), sc[j], s));
          }
        }
        if (g + 1 == KB / TG)
          for (int i = 0; i < valid; ++i) {
            const __m512 as = _mm512_set1_ps(c.a->scale[m + i]);
            float* yr = c.y + (size_t)(m + i) * c.ldy + nb * 16;
            for (int j = 0; j < NB; ++j)
              store_out(yr + j * 16, _mm512_mul_ps(_mm512_load_ps(fbuf[rb][i][j]), as), c.stream);
          }
      }
      pf.finish();
    }
  }
}

}  // namespace

void gemm_vnni(const QAct& a, const QLinear& w, float* y, int ldy, int nb0, int nb1) {
  const Ctx c{&a, &w, y, ldy, a.k / 64, stream_output(a, w, y, ldy)};
  if (a.m > 8 && a.m <= kPanelMaxRows) {
    for (int m = 0; m < a.m; m += kPanelRows) {
      const int rows = a.m - m < kPanelRows ? a.m - m : kPanelRows;
      int nb = nb0;
      for (; nb + 4 <= nb1; nb += 4) panel<4, 4>(c, m, rows, nb);
      for (; nb + 2 <= nb1; nb += 2) panel<8, 2>(c, m, rows, nb);
      if (nb < nb1) panel<8, 1>(c, m, rows, nb);
    }
  } else {
    // 8-row blocks start at rows 0 and 8 of each 16-row block, so the power-of-two round-up
    // below never leaves the (padded) block.
    for (int m = 0; m < a.m; m += 8) {
      const int valid = a.m - m < 8 ? a.m - m : 8;
      if (valid > 4) rows<8>(c, m, valid, nb0, nb1);
      else if (valid > 2) rows<4>(c, m, valid, nb0, nb1);
      else if (valid == 2) rows<2>(c, m, valid, nb0, nb1);
      else rows<1>(c, m, valid, nb0, nb1);
    }
  }
  if (c.stream) _mm_sfence();
}

#ifndef SG_KERNEL_EMULATION  // the emulated test build has no zmm registers to pin
uint64_t peak_loop_vnni(uint64_t iters) {
  __m512i u = _mm512_set1_epi8(3);
  const __m512i s = _mm512_set1_epi8(-5);
  __m512i acc[12];
  for (auto& v : acc) v = _mm512_setzero_si512();
  for (uint64_t it = 0; it < iters; ++it) {
    asm volatile("" : "+v"(u));  // an opaque operand keeps the loop honest
    for (auto& v : acc) v = _mm512_dpbusd_epi32(v, u, s);
  }
  __m512i t = acc[0];
  for (int i = 1; i < 12; ++i) t = _mm512_add_epi32(t, acc[i]);
  volatile int32_t sink = _mm512_reduce_add_epi32(t);
  (void)sink;
  return iters * 12 * 64 * 2;
}
#endif

}  // namespace sg::detail
