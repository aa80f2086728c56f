// A software prefetch spread over a loop's steps: one cache line per step() instead of a burst of them. A burst of
// prefetches fills the core's queue of outstanding misses and stalls the loads behind it; one line a step keeps the
// stream at the pace of the arithmetic. Used by the decode-batch GEMM panels (kernels/gemm_vnni.cpp) and the decode
// attention (engine/ops_avx512.cpp, engine/ops_avx2.cpp).
#pragma once

#include <xmmintrin.h>

#include <cstddef>
#include <cstdint>

namespace sg {

// `rows` rows of `lines` 64-byte lines each, the first at `row`, `stride` bytes apart; into L1 (prefetcht0).
// A prefetch never faults, so lines past the data a caller reads cost a little bandwidth, nothing more.
struct LinePrefetch {
  const uint8_t* row = nullptr;
  size_t stride = 0;
  int lines = 0;
  int rows = 0;
  int l = 0;  // the next line of the current row
  void step() {
    if (rows <= 0) return;
    _mm_prefetch(reinterpret_cast<const char*>(row + size_t(l) * 64), _MM_HINT_T0);
    if (++l == lines) l = 0, row += stride, --rows;
  }
  void finish() {
    while (rows > 0) step();
  }
};

}  // namespace sg
