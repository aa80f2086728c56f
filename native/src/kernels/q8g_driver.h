// The q8g GEMM's walk over panels and rows, shared by its AVX2 and AVX-512 kernels (gemm_q8g.cpp,
// gemm_q8g_avx512.cpp). Plain C++, but with internal linkage on purpose: each ISA's translation unit compiles its own
// copy with its own flags, so the linker can never hand the AVX-512 copy to a caller on an AVX2-only CPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "gemm.h"

namespace sg::detail {
namespace {

// One register block: mr activation rows (x, ldx) × np panels starting at codes/scales, written to y. With offsets
// (q8ga), xsum holds each row's per-group sums of x (row i at xsum + i·(k_total/group)); both are null otherwise.
using Q8gBlockFn = void (*)(const float* x, int ldx, const int8_t* codes, const float* scales, const float* offsets,
                            const float* xsum, int n_total, int k_total, int group, float* y, int ldy);

struct Q8gKernels {
  int max_rows;           // rows per register block, at most
  int panel_block;        // panels whose codes stay cached while every row block walks them
  const int* panels_for;  // [mr]: panels per register block for mr rows
  const Q8gBlockFn* wide; // [mr]: the kernel for mr rows × panels_for[mr] panels
  const Q8gBlockFn* one;  // [mr]: the kernel for mr rows × 1 panel (the remainder of a panel range)
  const Q8gBlockFn* wide_off;  // the same two with the offset term (q8ga)
  const Q8gBlockFn* one_off;
};

// Output columns of panels [p0, p1), all m rows. Rows go in balanced blocks of at most max_rows (8 rows on 6: 4 + 4,
// not 6 + 2, whose 2-row block would be bound by its few FMA chains); panels in blocks of panel_block, outermost.
// xsum: with offsets (q8ga), the group sums of the m rows ([m][K/G], gemm_q8g computes them once per call).
inline void q8g_drive(const Q8gKernels& kk, const float* x, int ldx, int m, const QLinear& w, const float* xsum,
                      float* y, int ldy, int p0, int p1) {
  const int8_t* codes = reinterpret_cast<const int8_t*>(w.codes);
  const float* scales = static_cast<const float*>(w.scales);
  const bool off = w.offsets != nullptr;
  const int ng = w.k / w.group;
  const int row_blocks = (m + kk.max_rows - 1) / kk.max_rows;
  const int rows_per_block = (m + row_blocks - 1) / row_blocks;
  for (int pb = p0; pb < p1; pb += kk.panel_block) {
    const int pe = std::min(pb + kk.panel_block, p1);
    for (int m0 = 0; m0 < m; m0 += rows_per_block) {
      const int mr = std::min(rows_per_block, m - m0);
      for (int q = pb; q < pe;) {
        const bool wide = q + kk.panels_for[mr] <= pe;
        const Q8gBlockFn* fns = off ? (wide ? kk.wide_off : kk.one_off) : (wide ? kk.wide : kk.one);
        fns[mr](x + size_t(m0) * ldx, ldx, codes + size_t(q) * w.k * 16, scales + size_t(q) * 16,
                off ? w.offsets + size_t(q) * 16 : nullptr, off ? xsum + size_t(m0) * ng : nullptr, w.n, w.k, w.group,
                y + size_t(m0) * ldy + size_t(q) * 16, ldy);
        q += wide ? kk.panels_for[mr] : 1;
      }
    }
  }
}

}  // namespace
}  // namespace sg::detail
