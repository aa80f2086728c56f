// The AMX backend (compiled with -mamx-tile -mamx-int8 -mavx512f -mavx512bw -mavx512vl -O2;
// called only when CPUID says AMX-TILE + AMX-INT8 and the kernel granted the tile state).
//
// Tiles: all eight are 16 rows × 64 bytes. tmm0–3 accumulate int32, tmm4–5 hold A tiles (16
// activation rows × 64 k, straight from the shared packed layout), tmm6–7 hold B tiles. A file
// tile (16 columns × 64 k, rows of 4 k × 16 columns) is exactly tdpbssd's B operand, so int8
// weights are loaded from the mapping as they are; int4 tiles are first unpacked to int8 into
// an L1 scratch tile. tdpbssd (s8 × s8 → int32) gives the exact sums directly; the float
// epilogue is the one in gemm.h, so results are bit-identical to the other backends.
//
// Blocking: a task is ≤ 4 column blocks (64 columns; its B panel stays in L2). Rows go in
// pairs of 16-row blocks with 2×2 tiles (2 A × 2 B → 4 accumulators); the last odd 16-row
// block, and with it every decode-sized call (M ≤ 16), uses 1×4 (1 A × 4 B, one weight read
// per column block). q8c accumulates over the whole K (prefill-sized calls: in K slices with the
// row pairs innermost, q8c_sliced); q4g over one scale group at a time, then drains the tiles
// into f32 sums.
//
// Compiler traps: the tile primitives (amx_tiles.h) carry memory clobbers, and an explicit
// barrier follows the scratch-tile stores.
// * KVM hosts can lose the tile state on preemption (tiles come back zeroed). With the guard
//   on, accumulators start from a sentinel 2^30 instead of 0; a stored tile whose column 0 is
//   below 2^29 was reset and the block is recomputed (then, after kMaxRetry losses, computed
//   exactly without tiles). Guard: FGM_TILE_GUARD=on|off, else decided once by a probe.
// The emulated test build (-DSG_KERNEL_EMULATION, emulation/) swaps the tile primitives for
// scalar tiles to run this file's logic on CPUs without AMX.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels_impl.h"
#include "amx_tiles.h"  // (the emulated test build: scalar tiles)

namespace sg::detail {
namespace {

using namespace sg::amx;

constexpr int32_t kSentinel = 1 << 30;
constexpr int32_t kSentinelMin = 1 << 29;
constexpr int kMaxRetry = 16;

struct SentinelTile {
  alignas(64) int32_t v[256];
  constexpr SentinelTile() : v() {
    for (auto& x : v) x = kSentinel;
  }
};
constexpr SentinelTile kSentinelTile{};


template <class F, int... I>
inline void unroll_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
inline void unroll(F&& f) {
  unroll_impl(f, std::make_integer_sequence<int, N>{});
}

// 16 tile rows of packed int4 (32 bytes each) → a 1 KB int8 B tile (low nibbles to bytes
// 0..31, high to 32..63, two's complement sign-extended).
inline void unpack_q4_tile(const uint8_t* src, int8_t* dst) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i eight = _mm512_set1_epi8(8);
  for (int t = 0; t < 16; ++t) {
    // The 32 bytes in both halves; the upper half shifted down to its high nibbles.
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + t * 32)));
    const __m512i z = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), low4);
    _mm512_store_si512(dst + t * 64, _mm512_sub_epi8(_mm512_xor_si512(z, eight), eight));
  }
}

// Where B tile (column block j of the block, k-block kb) comes from: the file for int8, an
// unpacked scratch tile for int4.
struct BSource {
  const QLinear* w;
  int KB;
  int nb;  // first column block of the block
  int8_t (*scratch)[1024];
  const int8_t* get(int j, int kb) const {
    if (w->dtype == DType::Q8C)
      return reinterpret_cast<const int8_t*>(w->codes) + ((size_t)(nb + j) * KB + kb) * 1024;
    unpack_q4_tile(w->codes + ((size_t)(nb + j) * KB + kb) * 512, scratch[j]);
    return scratch[j];
  }
};

// One attempt: accumulators (i, j) = tmm(i·NT + j) over k-blocks [kb0, kb1), starting from init (the sums of
// earlier k-blocks, biased alike) or from nothing, stored to out (never init: a failed attempt must be able to
// start again from it; without the guard out may be init). Returns false when the guard sees a reset tile.
template <int MT, int NT>
bool accumulate_tiles(const int8_t* A, size_t a_mstride, const BSource& bs, int kb0, int kb1, bool guard,
                      const int32_t (*init)[256], int32_t (*out)[256]) {
  static_assert(MT * NT <= 4 && MT <= 2, "four accumulator tiles, two A tiles");
  unroll<MT * NT>([&](auto c) {
    if (init) tile_load<decltype(c)::value>(init[decltype(c)::value]);
    else if (guard) tile_load<decltype(c)::value>(kSentinelTile.v);
    else tile_zero<decltype(c)::value>();
  });
  for (int kb = kb0; kb < kb1; ++kb) {
    const int8_t* bp[NT];
    for (int j = 0; j < NT; ++j) bp[j] = bs.get(j, kb);
    asm volatile("" ::: "memory");  // scratch-tile stores complete before any tileloadd
    unroll<MT>([&](auto i) { tile_load<4 + decltype(i)::value>(A + decltype(i)::value * a_mstride + (size_t)kb * 1024); });
    unroll<NT>([&](auto jc) {
      constexpr int j = decltype(jc)::value;
      tile_load<6 + (j & 1)>(bp[j]);
      unroll<MT>([&](auto ic) {
        constexpr int i = decltype(ic)::value;
        tile_dp<i * NT + j, 4 + i, 6 + (j & 1)>();
      });
    });
  }
  unroll<MT * NT>([&](auto c) { tile_store<decltype(c)::value>(out[decltype(c)::value]); });
  asm volatile("" ::: "memory");
  if (!guard) return true;
  for (int c = 0; c < MT * NT; ++c)
    for (int r = 0; r < 16; ++r)
      if (out[c][r * 16] < kSentinelMin) return false;
  return true;
}

// The same sums without tiles (after repeated tile-state loss): exact int32, biased alike.
template <int MT, int NT>
void accumulate_scalar(const int8_t* A, size_t a_mstride, const BSource& bs, int kb0, int kb1, bool guard,
                       const int32_t (*init)[256], int32_t (*out)[256]) {
  for (int c = 0; c < MT * NT; ++c)
    for (int e = 0; e < 256; ++e) out[c][e] = init ? init[c][e] : guard ? kSentinel : 0;
  for (int kb = kb0; kb < kb1; ++kb)
    for (int j = 0; j < NT; ++j) {
      const int8_t* b = bs.get(j, kb);  // b[t·64 + n·4 + e] = W[n, kb·64 + 4t + e]
      for (int i = 0; i < MT; ++i) {
        const int8_t* a = A + i * a_mstride + (size_t)kb * 1024;  // a[r·64 + kk]
        for (int r = 0; r < 16; ++r)
          for (int n = 0; n < 16; ++n) {
            int32_t s = 0;
            for (int kk = 0; kk < 64; ++kk) s += int32_t(a[r * 64 + kk]) * b[(kk / 4) * 64 + n * 4 + kk % 4];
            out[i * NT + j][r * 16 + n] += s;
          }
      }
    }
}

template <int MT, int NT>
void accumulate(const int8_t* A, size_t a_mstride, const BSource& bs, int kb0, int kb1, bool guard,
                const int32_t (*init)[256], int32_t (*out)[256]) {
  for (int attempt = 0; attempt < kMaxRetry; ++attempt) {
    if (accumulate_tiles<MT, NT>(A, a_mstride, bs, kb0, kb1, guard, init, out)) return;
    g_amx_recoveries.fetch_add(1, std::memory_order_relaxed);
  }
  accumulate_scalar<MT, NT>(A, a_mstride, bs, kb0, kb1, guard, init, out);
}

// Rows of 16-row block mb that hold activations (the last block of a call may be partial).
inline int valid_rows(const QAct& a, int mb) { return std::min(16, a.m - mb * 16); }

// The q8c epilogue of MT×NT accumulator tiles (row block mb, column block nb): y = (sum − bias) · row scale ·
// column scale, for the valid rows.
template <int MT, int NT>
void store_q8c(const QAct& a, const QLinear& w, float* y, int ldy, int mb, int nb, bool guard, bool stream,
               const int32_t (*out)[256]) {
  const __m512i bias = _mm512_set1_epi32(guard ? kSentinel : 0);
  const float* ws = static_cast<const float*>(w.scales);
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < valid_rows(a, mb + i); ++r) {
      const int m = (mb + i) * 16 + r;
      const __m512 as = _mm512_set1_ps(a.scale[m]);
      for (int j = 0; j < NT; ++j) {
        const __m512i acc = _mm512_sub_epi32(_mm512_load_si512(out[i * NT + j] + r * 16), bias);
        const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), as), _mm512_loadu_ps(ws + (nb + j) * 16));
        store_out(y + (size_t)m * ldy + (nb + j) * 16, f, stream);
      }
    }
}

// MT 16-row blocks starting at row block mb × NT column blocks starting at nb.
template <int MT, int NT>
void block(const QAct& a, const QLinear& w, float* y, int ldy, int mb, int nb, bool guard, bool stream) {
  const int KB = a.k / 64;
  alignas(64) int8_t scratch[NT][1024];
  alignas(64) int32_t out[MT * NT][256];
  const BSource bs{&w, KB, nb, scratch};
  const int8_t* A = a.packed + (size_t)mb * KB * 1024;
  const size_t a_mstride = (size_t)KB * 1024;
  if (w.dtype == DType::Q8C) {
    accumulate<MT, NT>(A, a_mstride, bs, 0, KB, guard, nullptr, out);
    store_q8c<MT, NT>(a, w, y, ldy, mb, nb, guard, stream, out);
    return;
  }
  const __m512i bias = _mm512_set1_epi32(guard ? kSentinel : 0);
  const int TG = w.group / 64;
  const uint16_t* scales = static_cast<const uint16_t*>(w.scales);
  alignas(64) float sums[MT * 16][NT * 16];
  for (auto& row : sums)
    for (float& v : row) v = 0.f;
  for (int g = 0; g < KB / TG; ++g) {
    accumulate<MT, NT>(A, a_mstride, bs, g * TG, (g + 1) * TG, guard, nullptr, out);
    for (int j = 0; j < NT; ++j) {
      const __m512 sc =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (size_t)g * w.n + (nb + j) * 16)));
      for (int i = 0; i < MT; ++i)
        for (int r = 0; r < 16; ++r) {
          const __m512i acc = _mm512_sub_epi32(_mm512_load_si512(out[i * NT + j] + r * 16), bias);
          float* s = &sums[i * 16 + r][j * 16];
          _mm512_store_ps(s, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sc, _mm512_load_ps(s)));
        }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < valid_rows(a, mb + i); ++r) {
      const int m = (mb + i) * 16 + r;
      const __m512 as = _mm512_set1_ps(a.scale[m]);
      for (int j = 0; j < NT; ++j)
        store_out(y + (size_t)m * ldy + (nb + j) * 16, _mm512_mul_ps(_mm512_load_ps(&sums[i * 16 + r][j * 16]), as), stream);
    }
}

// q8c over many rows (prefill): row pairs [mp0, mp1) of 2×16 rows against NT column blocks from nb (a column pair
// of the task, or its odd last block), with K cut into slices of kSliceBlocks k-blocks. A column pair's slice of weights (2 × 8 KB) stays in L1 while every
// row pair of the group passes over it, so per four tile products only the two A tiles come from L2, not all four
// operands (2×2 over the whole K reads 4 KB from L2 per 64 cycles of products: at the L2's bandwidth, ~45% of the
// tile peak). The accumulators go to memory between slices (4 KB out and in per 32 products), alternating between
// two buffers so that a slice the tile guard rejects starts again from the sums before it. Measured on a 2-core
// Xeon with AMX (docs/benchmarks.md, session 18): a standalone tile loop (one thread, M=256, N=64, K=1536, operands
// in L2) 3.7 TOPS against 2.9 (peak 6.2; slices of 4, 6, 12, 24 k-blocks: 3.2, 3.5, 3.4, 2.9); in the package
// (2 threads, weights cycled) the FFN gate 1.09-1.15x, gate+up 1.10-1.13x; E2B prefill 1024 1.00-1.07x, 8192 1.02-1.05x.
constexpr int kSliceBlocks = 8;
constexpr int kSliceRowPairs = 8;  // the row pairs of one group: their sums are 32 KB (64 with the guard)
// Up to this K. Beyond it the activations of a 256-row chunk (1.5 MB at K=6144, the FFN down projection) fill the
// L2 with the task's weights, and slicing measured 0.95x (2 threads; 1.05x on one); K of one slice gains nothing.
constexpr int kSliceMaxK = 4096;

template <int NT>
void q8c_sliced(const QAct& a, const QLinear& w, float* y, int ldy, int mp0, int mp1, int nb, bool guard, bool stream,
                int32_t (*buf)[2][4][256]) {
  const int KB = a.k / 64;
  const BSource bs{&w, KB, nb, nullptr};
  const size_t a_mstride = (size_t)KB * 1024;
  // Without the guard no attempt fails, and the sums stay in one buffer (in L1 with the slice of weights).
  auto at = [&](int p, int s) { return buf[p - mp0][guard ? s & 1 : 0]; };
  int s = 0;
  for (int k0 = 0; k0 < KB; k0 += kSliceBlocks, ++s) {
    const int k1 = k0 + kSliceBlocks < KB ? k0 + kSliceBlocks : KB;
    for (int p = mp0; p < mp1; ++p)
      accumulate<2, NT>(a.packed + (size_t)(2 * p) * a_mstride, a_mstride, bs, k0, k1, guard, k0 ? at(p, s) : nullptr,
                        at(p, s + 1));
  }
  for (int p = mp0; p < mp1; ++p) store_q8c<2, NT>(a, w, y, ldy, 2 * p, nb, guard, stream, at(p, s));
}

// The decode-shaped block: one 16-row block against up to four column blocks.
void block_1xn(const QAct& a, const QLinear& w, float* y, int ldy, int mb, int nb0, int nb1, bool guard, bool stream) {
  switch (nb1 - nb0) {
    case 4: block<1, 4>(a, w, y, ldy, mb, nb0, guard, stream); break;
    case 3: block<1, 3>(a, w, y, ldy, mb, nb0, guard, stream); break;
    case 2: block<1, 2>(a, w, y, ldy, mb, nb0, guard, stream); break;
    default: block<1, 1>(a, w, y, ldy, mb, nb0, guard, stream); break;
  }
}

// The probe for the tile-state defect: hold a pattern in tmm0 for a few milliseconds while
// spinner threads compete for every CPU; any difference when it is stored back means this
// host loses tile state on preemption.
bool tile_state_is_lost() {
  const unsigned ncpu = std::thread::hardware_concurrency();
  const unsigned n_spin = ncpu ? (2 * ncpu < 32 ? 2 * ncpu : 32) : 4;
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (unsigned i = 0; i < n_spin; ++i)
    spinners.emplace_back([&stop] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  alignas(64) int32_t pattern[256], back[256];
  for (int e = 0; e < 256; ++e) pattern[e] = 0x01010101 * (e % 97 + 1);
  bool lost = false;
  load_tile_config();
  for (int hold_ms : {2, 8}) {
    for (int trial = 0; trial < 4 && !lost; ++trial) {
      tile_load<0>(pattern);
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(hold_ms)) {
      }
      tile_store<0>(back);
      asm volatile("" ::: "memory");
      lost = std::memcmp(pattern, back, sizeof pattern) != 0;
    }
  }
  tile_release();
  stop = true;
  for (auto& t : spinners) t.join();
  return lost;
}

}  // namespace

void amx_prepare() {
  amx_thread_permission();
  if (g_amx_guard.load() >= 0) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lk(mu);
  if (g_amx_guard.load() >= 0) return;
  const char* env = std::getenv("FGM_TILE_GUARD");
  const std::string v = env ? env : "";
  int guard;
  if (v == "on") guard = 1;
  else if (v == "off") guard = 0;
  else if (v.empty()) guard = tile_state_is_lost() ? 1 : 0;
  else throw std::runtime_error("FGM_TILE_GUARD='" + v + "' must be 'on' or 'off' (unset: decided by a probe)");
  g_amx_guard.store(guard);
}

bool amx_guard_off() {
  amx_prepare();
  return g_amx_guard.load() == 0;
}

void gemm_amx(const QAct& a, const QLinear& w, float* y, int ldy, int nb0, int nb1) {
  amx_thread_permission();
  load_tile_config();
  // The sentinel needs |sum| < 2^29: true for every group of int4 and for int8 up to K ≈ 33k.
  const int64_t max_sum = w.dtype == DType::Q8C ? int64_t(w.k) * 127 * 127 : int64_t(w.group) * 127 * 8;
  const bool guard = g_amx_guard.load(std::memory_order_relaxed) != 0 && max_sum < kSentinelMin;
  const bool stream = stream_output(a, w, y, ldy);
  const int MB = (a.m + 15) / 16;
  int mb = 0;
  if (w.dtype == DType::Q8C && MB >= 4 && a.k / 64 > kSliceBlocks && a.k <= kSliceMaxK) {
    alignas(64) int32_t buf[kSliceRowPairs][2][4][256];
    for (int mp0 = 0; mp0 < MB / 2; mp0 += kSliceRowPairs) {
      const int mp1 = std::min(MB / 2, mp0 + kSliceRowPairs);
      int nb = nb0;
      for (; nb + 2 <= nb1; nb += 2) q8c_sliced<2>(a, w, y, ldy, mp0, mp1, nb, guard, stream, buf);
      if (nb < nb1) q8c_sliced<1>(a, w, y, ldy, mp0, mp1, nb, guard, stream, buf);
    }
    mb = MB / 2 * 2;
  }
  for (; mb + 2 <= MB; mb += 2) {
    int nb = nb0;
    for (; nb + 2 <= nb1; nb += 2) block<2, 2>(a, w, y, ldy, mb, nb, guard, stream);
    if (nb < nb1) block<2, 1>(a, w, y, ldy, mb, nb, guard, stream);
  }
  if (mb < MB)
    for (int nb = nb0; nb < nb1; nb += 4)
      block_1xn(a, w, y, ldy, mb, nb, nb + 4 < nb1 ? nb + 4 : nb1, guard, stream);
  if (stream) _mm_sfence();
  tile_release();
}

// The q8c kernel's 2×2 tile loop alone, without its epilogue or the K slices' accumulator round trips: 16 row blocks
// (a 256-row chunk) × 4 column blocks (one task) over 24 k-blocks (K = 1536, the FFN gate's), in the kernel's own
// operand layouts, 384 KB of activations and 96 KB of weights per thread, both in L2 after the first pass. FixedA /
// FixedB read every k-block's activation / weight tiles from the first k-block's address, so those stay in L1: the
// four variants bound the loop by where its operands come from (docs/benchmarks.md, session 24). One iteration is one
// pass; returns the int8 operations done (2 per multiply-add).
template <bool FixedA, bool FixedB>
uint64_t tile_loop_amx(uint64_t iters) {
  constexpr int MB = 16, NB = 4, KB = 24;
  amx_thread_permission();
  load_tile_config();
  struct alignas(64) Operands {
    int8_t a[MB * KB * 1024], b[NB * KB * 1024];
    int32_t out[4][256];
  };
  const auto ops = std::make_unique<Operands>();
  std::memset(ops->a, 1, sizeof ops->a);  // values do not change the speed
  std::memset(ops->b, 1, sizeof ops->b);
  for (uint64_t it = 0; it < iters; ++it)
    for (int nb = 0; nb < NB; nb += 2)
      for (int mb = 0; mb < MB; mb += 2) {
        unroll<4>([](auto c) { tile_zero<decltype(c)::value>(); });
        const int8_t* a0 = ops->a + (size_t)mb * KB * 1024;
        const int8_t* b0 = ops->b + (size_t)nb * KB * 1024;
        for (int kb = 0; kb < KB; ++kb) {
          const size_t ka = FixedA ? 0 : (size_t)kb * 1024, kw = FixedB ? 0 : (size_t)kb * 1024;
          tile_load<4>(a0 + ka);
          tile_load<5>(a0 + (size_t)KB * 1024 + ka);
          tile_load<6>(b0 + kw);
          tile_dp<0, 4, 6>();
          tile_dp<2, 5, 6>();
          tile_load<7>(b0 + (size_t)KB * 1024 + kw);
          tile_dp<1, 4, 7>();
          tile_dp<3, 5, 7>();
        }
        unroll<4>([&](auto c) { tile_store<decltype(c)::value>(ops->out[decltype(c)::value]); });
      }
  tile_release();
  return iters * (MB / 2) * (NB / 2) * KB * 4 * (16ull * 16 * 64) * 2;
}

uint64_t (*const tile_loop_amx_fns[4])(uint64_t) = {tile_loop_amx<false, false>, tile_loop_amx<true, false>,
                                                     tile_loop_amx<false, true>, tile_loop_amx<true, true>};

uint64_t peak_loop_amx(uint64_t iters) {
  amx_thread_permission();
  load_tile_config();
  alignas(64) static const int8_t operand[1024] = {};  // values do not change the speed
  tile_load<4>(operand);
  tile_load<5>(operand);
  tile_load<6>(operand);
  tile_load<7>(operand);
  unroll<4>([](auto c) { tile_zero<decltype(c)::value>(); });
  for (uint64_t it = 0; it < iters; ++it) {
    tile_dp<0, 4, 6>();
    tile_dp<1, 4, 7>();
    tile_dp<2, 5, 6>();
    tile_dp<3, 5, 7>();
  }
  alignas(64) int32_t out[256];
  tile_store<0>(out);
  tile_release();
  volatile int32_t sink = out[0];
  (void)sink;
  return iters * 4 * (16ull * 16 * 64) * 2;
}

}  // namespace sg::detail
