// The per-row activation quantiser of quantize_activations() (gemm.h), written once for the ymm (activations.cpp)
// and zmm (activations_avx512.cpp) translation units, each of which instantiates it with its own primitives:
//   Isa::fwht_block(src, dst)      x·H of 128 floats (H = H₁₂₈/√128, Sylvester order)
//   Isa::amax_of(p, n)             max |p[i]| over n floats (n a multiple of 64)
//   Isa::quantize64(p, scale, dst) 64 codes round-half-even(p[i] / scale) clamped to ±127 at dst; returns their sum
// Isa is a type local to the including file, so the two instantiations never meet at link time.
#pragma once

#include "gemm.h"

namespace sg::detail {

// Row `row` of x into the packed layout.
template <class Isa>
inline void quantize_row_with(const float* x, int k, int hadamard, int row, QAct* out) {
  const int KB = k / 64;
  int8_t* dst = out->packed + ((size_t)(row / 16) * KB * 16 + row % 16) * 64;  // k-block kb at + kb·1024
  int32_t* rs = out->rowsum + (size_t)row * KB;
  // The rotated row is kept on the stack for pass 2 when it fits; longer rows are rotated
  // again block by block (the transform is deterministic, so both passes see the same values).
  constexpr int kCachedK = 16384;
  alignas(64) float rotated[kCachedK];
  const bool cached = hadamard && k <= kCachedK;
  float amax = 0.f;
  if (hadamard) {
    for (int b = 0; b < k; b += 128) {
      float* dst = cached ? rotated + b : rotated;
      Isa::fwht_block(x + b, dst);
      const float m = Isa::amax_of(dst, 128);
      amax = m > amax ? m : amax;
    }
  } else {
    amax = Isa::amax_of(x, k);
  }
  const float scale = amax > 0.f ? amax / 127.0f : 1.0f;
  out->scale[row] = scale;
  for (int kb = 0; kb < KB; ++kb) {
    const float* src;
    if (cached) {
      src = rotated + (size_t)kb * 64;
    } else if (hadamard) {
      if (kb % 2 == 0) Isa::fwht_block(x + (size_t)kb * 64, rotated);
      src = rotated + (kb % 2) * 64;
    } else {
      src = x + (size_t)kb * 64;
    }
    rs[kb] = Isa::quantize64(src, scale, dst + (size_t)kb * 1024);
  }
}

}  // namespace sg::detail
