// The q8g GEMM's walk over panels and rows, shared by its AVX2 and AVX-512 kernels (gemm_q8g.cpp,
// gemm_q8g_avx512.cpp; the AMX kernel, gemm_q8g_amx.cpp, walks its own way and takes PrefetchTrickle). Plain C++,
// but with internal linkage on purpose: each ISA's translation unit compiles its own copy with its own flags, so the
// linker can never hand the AVX-512 copy to a caller on an AVX2-only CPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <immintrin.h>
#include <vector>

#include "kernels_impl.h"

namespace sg::detail {
namespace {

// The activation rows a register block reads, from its first: f32 rows (the weight-only contract) or rows of the
// int8 activations (Q8gActs, kernels_impl.h).
struct F32Rows {
  const float* x;
  int ldx;
  F32Rows at(int r) const { return {x + size_t(r) * ldx, ldx}; }
};
struct Int8Rows {
  const Q8gActs* a;
  int m0;
  Int8Rows at(int r) const { return {a, m0 + r}; }
};

// One register block: mr activation rows × np panels starting at codes/scales, written to y. With offsets (q8ga),
// xsum holds each row's per-group sums of the f32 x (row i at xsum + i·(k_total/group)); both are null otherwise.
// pf, pf_bytes: codes the block prefetches into L2 while it runs, spread evenly over its walk along K (the driver's
// share for it of the panels that come next).
template <class Rows>
using Q8gBlockFn = void (*)(const Rows& rows, const int8_t* codes, Q8gScales scales, const float* offsets,
                            const float* xsum, int n_total, int k_total, int group, float* y, int ldy,
                            const int8_t* pf, size_t pf_bytes);

// The bytes/64 lines at pf prefetched evenly over `steps` calls of step(), in order: an add and a compare a step
// (Bresenham), no division; a trickle, not bursts (a group's share at once measured slower at one row).
class PrefetchTrickle {
 public:
  PrefetchTrickle(const int8_t* pf, size_t bytes, size_t steps) : p_(pf), lines_(bytes / 64), steps_(steps) {}
  void step() {
    for (acc_ += lines_; acc_ >= steps_; acc_ -= steps_, p_ += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p_), _MM_HINT_T1);
  }

 private:
  const int8_t* p_;
  size_t lines_, steps_, acc_ = 0;
};

// A group's scales of the NP panels after a register block's own (the next block's), into L2 one block ahead.
// s: the group's scales of the block's first panel.
template <int NP>
inline void prefetch_next_scales(Q8gScales s) {
  for (int p = 0; p < NP; ++p) _mm_prefetch((s + 16 * (NP + p)).bytes(), _MM_HINT_T1);
}

template <class Rows>
struct Q8gFns {
  const Q8gBlockFn<Rows>* wide;      // [mr]: the kernel for mr rows × panels_for[mr] panels
  const Q8gBlockFn<Rows>* one;       // [mr]: the kernel for mr rows × 1 panel (the remainder of a panel range)
  const Q8gBlockFn<Rows>* wide_off;  // the same two with the offset term (q8ga)
  const Q8gBlockFn<Rows>* one_off;
};

// Rewrites `bytes` bytes of consecutive panels' codes (a multiple of 64) into the order a kernel reads them in.
using Q8gRepackFn = void (*)(const int8_t* codes, size_t bytes, int8_t* out);

template <class Rows>
struct Q8gKernels {
  int max_rows;           // rows per register block, at most
  int panel_block;        // panels whose codes stay cached while every row block walks them
  const int* panels_for;  // [mr]: panels per register block for mr rows
  Q8gFns<Rows> fns;       // the kernels: they read the weight's codes as they are, or as `repack` writes them
  // Optional, where many row blocks walk each panel block (prefill): each panel block's codes rewritten once into a
  // scratch buffer, for every row block's kernel to read.
  Q8gRepackFn repack = nullptr;
};

// Output columns of panels [p0, p1), all m rows. Rows go in blocks of q8g_rows_per_block (kernels_impl.h); panels
// in blocks of panel_block, outermost.
// xsum: with offsets (q8ga), the group sums of the m rows ([m][K/G], gemm_q8g computes them once per call).
// Streaming: the mmap'd weights sit on 4 KB pages where the hardware prefetcher stops, so each call prefetches
// codes it does not read itself. A single row block (a decode batch within the kernel's max_rows) prefetches the np
// panels after its own, the next call's. Several row blocks walk each panel block, and only the first reads it from memory: had that one
// prefetched the next panels alone, it would ask for them within a third of the time at 32 rows, at the int8 rate
// faster than the DRAM gives them; so every call prefetches a share of the next panel block in proportion to its
// panels (row block j of nb, panels q .. q+np of the W: (jW + q − pb) / nbW .. + np / nbW). In-process A/B on Zen 5,
// Gemma 3 270M: at B=1 the one-block-ahead distance took 0.93x the time of shares of the next panel block; at B=32
// the shares took 0.97x (median of 10-16 alternated rounds).
template <class Rows>
inline void q8g_drive(const Q8gKernels<Rows>& kk, const Rows& rows, int m, const QLinear& w, const float* xsum,
                      float* y, int ldy, int p0, int p1) {
  const int8_t* codes = reinterpret_cast<const int8_t*>(w.codes);
  const Q8gScales scales = q8g_scales(w);
  const bool off = w.offsets != nullptr;
  const int ng = w.k / w.group;
  const int rows_per_block = q8g_rows_per_block(m, kk.max_rows);
  const int row_blocks = (m + rows_per_block - 1) / rows_per_block;
  const size_t panel_bytes = size_t(w.k) * 16;
  // One scratch buffer per thread (each translation unit its own), grown to the largest panel block it has held.
  thread_local std::vector<int8_t> scratch;
  int8_t* repacked = nullptr;
  if (kk.repack) {
    scratch.resize(size_t(kk.panel_block) * panel_bytes + 64);
    repacked = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
  }
  for (int pb = p0; pb < p1; pb += kk.panel_block) {
    const int pe = std::min(pb + kk.panel_block, p1), width = pe - pb;
    const int8_t* block_codes = codes + size_t(pb) * panel_bytes;
    if (kk.repack) {
      kk.repack(block_codes, size_t(width) * panel_bytes, repacked);
      block_codes = repacked;
    }
    // what follows in the weight (another task's panels past p1 too: the thread may take that task next)
    const size_t next_bytes = size_t(std::min(pe + kk.panel_block, w.n / 16) - pe) * panel_bytes;
    const int8_t* next = codes + size_t(pe) * panel_bytes;
    const size_t share = size_t(row_blocks) * width;
    for (int m0 = 0, j = 0; m0 < m; m0 += rows_per_block, ++j) {
      const int mr = std::min(rows_per_block, m - m0);
      for (int q = pb; q < pe;) {
        const bool wide = q + kk.panels_for[mr] <= pe;
        const int np = wide ? kk.panels_for[mr] : 1;
        // one row block: the np panels after its own (which it reads next), the distance measured best at B=1
        const int8_t* pf = codes + size_t(q + np) * panel_bytes;
        size_t pf_bytes = size_t(np) * panel_bytes;
        if (row_blocks > 1) {
          const size_t pf0 = next_bytes * (size_t(j) * width + (q - pb)) / share / 64 * 64;
          pf = next + pf0;
          pf_bytes = next_bytes * (size_t(j) * width + (q - pb) + np) / share / 64 * 64 - pf0;
        }
        const Q8gFns<Rows>& f = kk.fns;
        const Q8gBlockFn<Rows>* fn = off ? (wide ? f.wide_off : f.one_off) : (wide ? f.wide : f.one);
        fn[mr](rows.at(m0), block_codes + size_t(q - pb) * panel_bytes, scales + size_t(q) * 16,
                off ? w.offsets + size_t(q) * 16 : nullptr, off ? xsum + size_t(m0) * ng : nullptr, w.n, w.k, w.group,
                y + size_t(m0) * ldy + size_t(q) * 16, ldy, pf, pf_bytes);
        q += np;
      }
    }
  }
}

}  // namespace
}  // namespace sg::detail
