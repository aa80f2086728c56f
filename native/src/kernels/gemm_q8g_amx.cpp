// The q8g GEMM with int8 activations on AMX tiles (compiled with the AMX flags; called by gemm_q8g_multi on the AMX
// backend for calls of kQ8gAmxMinRows rows or more, where amx_tiles_usable() said yes). Gemma 3 270M, the default
// model, is all q8g: without this its GEMMs ran the VNNI kernel on AMX hosts too.
//
// gemm.h's contract per unit of U inputs (16 for group 16, else 32): the exact int32 sum of code products, then
// y = fma((float)sum, fl(a · s), y) unit by unit, and a q8ga weight's offsets after. tdpbssd (s8 × s8) gives each
// unit's sums of 16 rows × 16 columns at once (A: 16 activation rows × U bytes, B: U/4 tile rows of 16 columns × 4
// inputs), exact: no bias, no flipped codes. The sums go through memory (a tile store) into the fold, which is the
// VNNI kernel's operation for operation (gemm_q8g_avx512.cpp), so the bits are the same.
//
// Per panel (16 columns): its codes are transposed into B's layout (vpermb), then each block of 16 rows walks K with
// its 16 f32 sums in zmm registers; the tile products run three units ahead of the fold in four accumulators, so the
// tile unit works while the vector units fold. A decode batch of up to 16 rows walks all its panels as one stream
// instead (stream_rows). The next codes are prefetched over the walk (the weights sit on 4 KB pages, where the
// hardware prefetcher stops), the scales ahead of the products.
// Where it stands (a Xeon with AMX, docs/benchmarks.md sessions 19 and 25): the fold's three vector operations per 16
// outputs and unit (convert, scale product, FMA) are the bound, not the tile products, which at U = 32 use half the
// tile unit's K; 0.5-0.8 int8 TOPS on 2 threads, 1.1-1.4x the VNNI kernel's speed from 9 rows.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels_impl.h"
#include "q8g_driver.h"
#include "q8g_zmm.h"
#include "amx_tiles.h"  // (the emulated test build: scalar tiles)

namespace sg::detail {
namespace {

using namespace sg::amx;

struct PanelArgs {
  const int8_t* bt;      // the panel's codes in B's layout: unit u's tile at u·U·16
  Q8gScales scales;      // the panel's column 0 of group 0 ([K/G][N])
  const float* offsets;  // the same for q8ga, else null
  int n_total, k_total, group;
};

// Unit u's product for the rows at x (row stride K) into accumulator C, from A tile TA and B tile TB (the unit's
// codes in B's layout at b).
template <int C, int TA, int TB, int U>
inline void product(const int8_t* x, long k_total, const int8_t* b, int u) {
  tile_zero<C>();
  tile_load<TA>(x + size_t(u) * U, k_total);
  tile_load<TB>(b);
  tile_dp<C, TA, TB>();
}

// Where the fold of the next unit finds its scales: the folds go in unit order, the weight scales move on a group,
// the activation scales every 32 inputs.
struct FoldScales {
  Q8gScales ws;      // the weight scales of the panel's 16 columns
  const float* as;   // the activation scales of the block's rows
  int ws_left, as_left;
};

// acc[i] = fma((float)sum[i], fl(ws · as[i]), acc[i]) for the MR rows of one unit's stored sums (16 × 16 int32).
// Always inlined with acc a reference to the caller's array, so that the sums stay in zmm registers (through a
// lambda's capture GCC kept them in memory: a load and a store beside each FMA, 2x the time of the whole kernel).
template <int MR, int U>
__attribute__((always_inline)) inline void fold(__m512 (&acc)[MR], const int32_t* sums, FoldScales& f,
                                                const PanelArgs& pa, int m, PrefetchTrickle& next) {
  const __m512 sv = load_scales16(f.ws);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * i)),
                             _mm512_mul_ps(sv, _mm512_set1_ps(f.as[i])), acc[i]);
  if (--f.ws_left == 0) f.ws = f.ws + size_t(pa.n_total), f.ws_left = pa.group / U;
  if (--f.as_left == 0) f.as += m, f.as_left = 32 / U;
  next.step();
}

// MR rows (of the 16 the tiles hold) from row m0, one panel, all K: y = the contract's sums, then the offsets.
// Step u: unit u's product into accumulator u % 4, unit u - 1's stored to memory, unit u - 3's folded: the store does
// not wait on a product just issued, nor the fold's loads on a store just issued (a tile store is not forwarded to
// loads). One thread, M = 256, N = 2048, K = 640, a standalone probe of this loop: the products alone 5.4 ns a unit
// (16 rows), the folds alone 9.3, both 17.1, with the stores 20.2; folding each unit right after its store, ~40.
template <int MR, int U, bool OFF>
void panel_rows(const Q8gActs& a, int m0, const PanelArgs& pa, const float* xsum, float* y, int ldy,
                PrefetchTrickle& next) {
  const int8_t* x = a.codes + size_t(m0) * pa.k_total;
  const long k = pa.k_total;
  const int units = pa.k_total / U;
  alignas(64) int32_t sums[4][256];
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  FoldScales f{pa.scales, a.scale + m0, pa.group / U, 32 / U};
#define SG_Q8G_AMX_STEP(C, u)                                                                 \
  do {                                                                                        \
    if ((u) < units) product<C, 4 + ((C) & 1), 6 + ((C) & 1), U>(x, k, pa.bt + size_t(u) * U * 16, (u)); \
    if ((u) >= 1 && (u) - 1 < units) tile_store<((C) + 3) % 4>(sums[((C) + 3) % 4]);          \
    if ((u) >= 3 && (u) - 3 < units) fold<MR, U>(acc, sums[((C) + 1) % 4], f, pa, a.m, next); \
  } while (0)
  for (int u = 0; u < units + 3; u += 4) {
    SG_Q8G_AMX_STEP(0, u);
    SG_Q8G_AMX_STEP(1, u + 1);
    SG_Q8G_AMX_STEP(2, u + 2);
    SG_Q8G_AMX_STEP(3, u + 3);
  }
#undef SG_Q8G_AMX_STEP
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + size_t(i) * ldy, acc[i]);
  if constexpr (OFF) add_offsets_zmm<MR, 1>(pa.offsets, xsum, pa.n_total, pa.k_total, pa.group, y, ldy);
}

using PanelRowsFn = void (*)(const Q8gActs&, int, const PanelArgs&, const float*, float*, int, PrefetchTrickle&);
template <int U, bool OFF, int... I>  // I = rows - 1
constexpr std::array<PanelRowsFn, 17> rows_table(std::integer_sequence<int, I...>) {
  return {nullptr, panel_rows<I + 1, U, OFF>...};
}
template <int U, bool OFF>
constexpr auto kRows = rows_table<U, OFF>(std::make_integer_sequence<int, 16>{});

// Panels' K × 16 codes (input-major: 4 inputs × 16 columns a 64-byte line) as U/4-row B tiles (16 columns × 4
// inputs a tile row): one vpermb a line (AVX512-VBMI, which every AMX CPU has; the VNNI kernels' PanelTranspose
// takes two shuffles). Per-panel walks at 8-32 rows of the LM head, 2 threads: 0.87-0.94x the time.
alignas(64) constexpr int8_t kTileOrder[64] = {0,  16, 32, 48, 1,  17, 33, 49, 2,  18, 34, 50, 3,  19, 35, 51,
                                               4,  20, 36, 52, 5,  21, 37, 53, 6,  22, 38, 54, 7,  23, 39, 55,
                                               8,  24, 40, 56, 9,  25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
                                               12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
__attribute__((always_inline)) inline void transpose_panels(const int8_t* codes, size_t bytes, int8_t* out) {
  const __m512i order = _mm512_load_si512(kTileOrder);
  for (size_t o = 0; o < bytes; o += 64)
    _mm512_store_si512(out + o, _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + o)));
}

// One row block (MR <= 16 rows, as the tiles were configured) against panels [p0, p1), as one stream of units
// (t = panel · units + unit): the steps of panel_rows, but a panel ends in its last unit's fold (its outputs written,
// a q8ga weight's offsets added) while the next panel's products already run, and each unit is transposed two steps
// before its product into a ring of four. A per-panel walk pays the pipeline's fill and drain every 20 units
// (Gemma 3 270M's K) and the transposition as a pass of its own, where the weights' first loads wait on memory. The
// codes are prefetched a unit a step, kPrefetchUnits ahead; a panel's scales (and offsets) when its products start,
// two panels ahead. Xeon with AMX, 2 threads (docs/benchmarks.md session 25): with the weights in the L3 0.87x the
// time of per-panel walks at 8 and 16 rows, the LM head streamed 0.93x; in a standalone loop a unit's product, store
// and fold take 13 ns at 8 rows, 17.5 with its transposition.
constexpr long kPrefetchUnits = 40;

template <int MR, int U, bool OFF>
void stream_rows(const Q8gActs& a, const QLinear& w, const float* xsum, float* y, int ldy, int p0, int p1) {
  constexpr size_t ub = size_t(U) * 16;  // a unit's code bytes
  const int8_t* codes = reinterpret_cast<const int8_t*>(w.codes) + size_t(p0) * w.k * 16;
  const int8_t* end = reinterpret_cast<const int8_t*>(w.codes) + size_t(w.n) * w.k;
  const Q8gScales scales = q8g_scales(w);
  const long k = w.k, units = w.k / U, total = long(p1 - p0) * units;
  const int ng = w.k / w.group;
  alignas(64) int32_t sums[4][256];
  alignas(64) int8_t ring[4][ub];
  const int8_t* pf = codes + kPrefetchUnits * ub;
  PrefetchTrickle next(pf, pf < end ? std::min(size_t(end - pf), size_t(total) * ub) : 0, size_t(total));
  const auto prefetch_scales = [&](int q) {
    if (q >= w.n / 16) return;
    for (int g = 0; g < ng; ++g) {
      const size_t at = size_t(g) * w.n + 16 * size_t(q);
      _mm_prefetch((scales + at).bytes(), _MM_HINT_T1);
      if (OFF) _mm_prefetch(reinterpret_cast<const char*>(w.offsets + at), _MM_HINT_T1);
    }
  };
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  int pu = 0, pp = p0;  // the products' unit and panel
  int fu = 0, fp = p0;  // the folds'
  PanelArgs pa{nullptr, scales + 16 * size_t(p0), OFF ? w.offsets + 16 * size_t(p0) : nullptr, w.n, w.k, w.group};
  FoldScales f{pa.scales, a.scale, w.group / U, 32 / U};
  transpose_panels(codes, ub, ring[0]);
  if (total > 1) transpose_panels(codes + ub, ub, ring[1]);
#define SG_Q8G_AMX_STREAM_STEP(C, t)                                                                              \
  do {                                                                                                            \
    if ((t) + 2 < total) transpose_panels(codes + size_t((t) + 2) * ub, ub, ring[((C) + 2) % 4]);                \
    if ((t) < total) {                                                                                            \
      if (pu == 0) prefetch_scales(pp + 2);                                                                       \
      product<C, 4 + ((C) & 1), 6 + ((C) & 1), U>(a.codes, k, ring[C], pu);                                       \
      if (++pu == units) pu = 0, ++pp;                                                                            \
    }                                                                                                             \
    if ((t) >= 1 && (t) - 1 < total) tile_store<((C) + 3) % 4>(sums[((C) + 3) % 4]);                            \
    if ((t) >= 3 && (t) - 3 < total) {                                                                            \
      fold<MR, U>(acc, sums[((C) + 1) % 4], f, pa, a.m, next);                                                    \
      if (++fu == units) {                                                                                        \
        float* yo = y + 16 * size_t(fp);                                                                          \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {                                                   \
          _mm512_storeu_ps(yo + size_t(i) * ldy, acc[i]);                                                         \
          acc[i] = _mm512_setzero_ps();                                                                           \
        }                                                                                                         \
        if constexpr (OFF) add_offsets_zmm<MR, 1>(pa.offsets, xsum, w.n, w.k, w.group, yo, ldy);                  \
        fu = 0, ++fp;                                                                                             \
        pa.scales = pa.scales + 16, pa.offsets = OFF ? pa.offsets + 16 : nullptr;                                 \
        f = FoldScales{pa.scales, a.scale, w.group / U, 32 / U};                                                  \
      }                                                                                                           \
    }                                                                                                             \
  } while (0)
  for (long t = 0; t < total + 3; t += 4) {
    SG_Q8G_AMX_STREAM_STEP(0, t);
    SG_Q8G_AMX_STREAM_STEP(1, t + 1);
    SG_Q8G_AMX_STREAM_STEP(2, t + 2);
    SG_Q8G_AMX_STREAM_STEP(3, t + 3);
  }
#undef SG_Q8G_AMX_STREAM_STEP
}

using StreamRowsFn = void (*)(const Q8gActs&, const QLinear&, const float*, float*, int, int, int);
template <int U, bool OFF, int... I>  // I = rows - 1
constexpr std::array<StreamRowsFn, 17> stream_table(std::integer_sequence<int, I...>) {
  return {nullptr, stream_rows<I + 1, U, OFF>...};
}
template <int U, bool OFF>
constexpr auto kStreams = stream_table<U, OFF>(std::make_integer_sequence<int, 16>{});

// More rows: panels transposed and walked together, each by every row block in turn: one for decode batches of two
// row blocks, whose next panel streams in while it is walked; four for more rows, so that a row's outputs are written
// 256 bytes at a time, not 64 (the LM head's rows lie 1 MB apart: a page each). 2 threads, amx time over vnni: the LM
// head at 256 rows 0.98-0.99 in blocks of four, 1.19-1.20 one by one; at 32 rows 0.98-1.00 in blocks of four, 0.87
// one by one; the FFN shapes alike (session 19). The stream of one row block, tried for these too, was slower.
constexpr int kPrefillPanelBlock = 4;

template <int U>
void panels(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0, int p1) {
  const int8_t* codes = reinterpret_cast<const int8_t*>(w.codes);
  const Q8gScales scales = q8g_scales(w);
  const bool off = w.offsets != nullptr;
  const int ng = w.k / w.group, panels_total = w.n / 16, row_blocks = (m + 15) / 16;
  if (row_blocks == 1) {
    (off ? kStreams<U, true> : kStreams<U, false>)[m](a, w, xsum, y, ldy, p0, p1);
    return;
  }
  const size_t panel_bytes = size_t(w.k) * 16;
  thread_local std::vector<int8_t> scratch;  // a block of panels' codes in B's layout
  const int block = row_blocks > 2 ? kPrefillPanelBlock : 1;
  scratch.resize(size_t(block) * panel_bytes + 64);
  int8_t* bt = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
  const auto& fns = off ? kRows<U, true> : kRows<U, false>;
  for (int pb = p0; pb < p1; pb += block) {
    const int pe = std::min(pb + block, p1);
    transpose_panels(codes + size_t(pb) * panel_bytes, size_t(pe - pb) * panel_bytes, bt);
    // The next block (another task's past p1 too: the thread may take that task next): its scales now, its codes
    // trickled over this block's walk.
    const int ne = std::min(pe + block, panels_total);
    for (int g = 0; g < ng; ++g)
      for (int q = pe; q < ne; ++q) {
        _mm_prefetch((scales + (size_t(g) * w.n + 16 * q)).bytes(), _MM_HINT_T1);
        if (off) _mm_prefetch(reinterpret_cast<const char*>(w.offsets + size_t(g) * w.n + 16 * q), _MM_HINT_T1);
      }
    PrefetchTrickle next(codes + size_t(pe) * panel_bytes, size_t(ne - pe) * panel_bytes,
                         size_t(w.k / U) * row_blocks * (pe - pb));
    for (int m0 = 0; m0 < m; m0 += 16)
      for (int q = pb; q < pe; ++q) {
        const PanelArgs pa{bt + size_t(q - pb) * panel_bytes, scales + size_t(q) * 16,
                           off ? w.offsets + size_t(q) * 16 : nullptr, w.n, w.k, w.group};
        fns[std::min(16, m - m0)](a, m0, pa, off ? xsum + size_t(m0) * ng : nullptr, y + size_t(m0) * ldy + 16 * q,
                                  ldy, next);
      }
  }
}

}  // namespace

void gemm_q8g_int8_panels_amx(const Q8gActs& a, int m, const QLinear& w, const float* xsum, float* y, int ldy, int p0,
                              int p1) {
  amx_thread_permission();
  const int unit = w.group == 16 ? 16 : 32;
  load_tile_config(unit, std::min(m, 16));
  if (unit == 16) panels<16>(a, m, w, xsum, y, ldy, p0, p1);
  else panels<32>(a, m, w, xsum, y, ldy, p0, p1);
  tile_release();
}

}  // namespace sg::detail
