// The q8g GEMM's walk over panels and rows, shared by its AVX2 and AVX-512 kernels (gemm_q8g.cpp,
// gemm_q8g_avx512.cpp). Plain C++, but with internal linkage on purpose: each ISA's translation unit compiles its own
// copy with its own flags, so the linker can never hand the AVX-512 copy to a caller on an AVX2-only CPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <immintrin.h>

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
using Q8gBlockFn = void (*)(const Rows& rows, const int8_t* codes, const float* scales, const float* offsets,
                            const float* xsum, int n_total, int k_total, int group, float* y, int ldy,
                            const int8_t* pf, size_t pf_bytes);

// Prefetches lines [part·L/parts, (part+1)·L/parts) of the L = bytes/64 lines at pf: a kernel's share for one of
// the `parts` steps (groups, units) of its walk.
inline void prefetch_part(const int8_t* pf, size_t bytes, int part, int parts) {
  const size_t lines = bytes / 64, l0 = lines * part / parts, l1 = lines * (part + 1) / parts;
  for (size_t l = l0; l < l1; ++l) _mm_prefetch(reinterpret_cast<const char*>(pf + 64 * l), _MM_HINT_T1);
}

template <class Rows>
struct Q8gKernels {
  int max_rows;                  // rows per register block, at most
  int panel_block;               // panels whose codes stay cached while every row block walks them
  const int* panels_for;         // [mr]: panels per register block for mr rows
  const Q8gBlockFn<Rows>* wide;  // [mr]: the kernel for mr rows × panels_for[mr] panels
  const Q8gBlockFn<Rows>* one;   // [mr]: the kernel for mr rows × 1 panel (the remainder of a panel range)
  const Q8gBlockFn<Rows>* wide_off;  // the same two with the offset term (q8ga)
  const Q8gBlockFn<Rows>* one_off;
};

// Output columns of panels [p0, p1), all m rows. Rows go in blocks of q8g_rows_per_block (kernels_impl.h); panels
// in blocks of panel_block, outermost.
// xsum: with offsets (q8ga), the group sums of the m rows ([m][K/G], gemm_q8g computes them once per call).
// Streaming: while every row block walks one panel block, the codes of the next panel block are prefetched, each
// call its share in proportion to its panels (row block j of nb, panels q .. q+np of the W: share (jW + q − pb) / nbW
// .. + np / nbW). The mmap'd weights sit on 4 KB pages where the hardware prefetcher stops. Only the first row block
// reads the panel block from memory; had it also prefetched all of the next (one block ahead, as a single row block
// does), it would have asked for the next block's bytes within a third of the time at 32 rows: at the int8 rate,
// faster than the DRAM gives them.
template <class Rows>
inline void q8g_drive(const Q8gKernels<Rows>& kk, const Rows& rows, int m, const QLinear& w, const float* xsum,
                      float* y, int ldy, int p0, int p1) {
  const int8_t* codes = reinterpret_cast<const int8_t*>(w.codes);
  const float* scales = static_cast<const float*>(w.scales);
  const bool off = w.offsets != nullptr;
  const int ng = w.k / w.group;
  const int rows_per_block = q8g_rows_per_block(m, kk.max_rows);
  const int row_blocks = (m + rows_per_block - 1) / rows_per_block;
  const size_t panel_bytes = size_t(w.k) * 16;
  for (int pb = p0; pb < p1; pb += kk.panel_block) {
    const int pe = std::min(pb + kk.panel_block, p1), width = pe - pb;
    // what follows in the weight (another task's panels past p1 too: the thread may take that task next)
    const size_t next_bytes = size_t(std::min(pe + kk.panel_block, w.n / 16) - pe) * panel_bytes;
    const int8_t* next = codes + size_t(pe) * panel_bytes;
    const size_t share = size_t(row_blocks) * width;
    for (int m0 = 0, j = 0; m0 < m; m0 += rows_per_block, ++j) {
      const int mr = std::min(rows_per_block, m - m0);
      for (int q = pb; q < pe;) {
        const bool wide = q + kk.panels_for[mr] <= pe;
        const int np = wide ? kk.panels_for[mr] : 1;
        const size_t pf0 = next_bytes * (size_t(j) * width + (q - pb)) / share / 64 * 64;
        const size_t pf1 = next_bytes * (size_t(j) * width + (q - pb) + np) / share / 64 * 64;
        const Q8gBlockFn<Rows>* fns = off ? (wide ? kk.wide_off : kk.one_off) : (wide ? kk.wide : kk.one);
        fns[mr](rows.at(m0), codes + size_t(q) * panel_bytes, scales + size_t(q) * 16,
                off ? w.offsets + size_t(q) * 16 : nullptr, off ? xsum + size_t(m0) * ng : nullptr, w.n, w.k, w.group,
                y + size_t(m0) * ldy + size_t(q) * 16, ldy, next + pf0, pf1 - pf0);
        q += np;
      }
    }
  }
}

}  // namespace
}  // namespace sg::detail
