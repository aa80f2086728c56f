// The ISA-independent half of the attention kernels, shared by ops_avx2.cpp (ymm) and ops_avx512.cpp (zmm): the ring
// runs of the cached positions, the software prefetch of the rows ahead (prefetch_ahead, head_rows), the blocks of
// heads a pass takes (for_head_blocks), the folding of the softmax normaliser and the V scales into the weights, and
// the loop over blocks of up to 8 query heads; and by the tile kernels (attend_rows_avx2.cpp, attend_rows_avx512.cpp):
// the spans of a prefill block, their union, the stats a span row asks for; and the merge of a row's parts.
// Everything here has internal linkage (an unnamed namespace), so each file compiles its own copy with its own ISA
// flags and the linker never hands the AVX-512 copy to the AVX2 path.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "line_prefetch.h"
#include "ops.h"

namespace sg::ops {
namespace {

// The cached positions [lo, lo + span) as at most two runs of consecutive cache rows (the ring wraps once at most).
struct Run {
  int row, len, off;  // first cache row, row count, offset of the run's first position within [lo, lo + span)
};
inline int ring_runs(int lo, int span, int cap, Run* runs) {
  const int r0 = lo % cap, n0 = span < cap - r0 ? span : cap - r0;
  runs[0] = Run{r0, n0, 0};
  if (n0 == span) return 1;
  runs[1] = Run{0, span - n0, n0};
  return 2;
}

// The decode kernels' software prefetch reads the K rows this many rows ahead (LinePrefetch, one line a step): ~8 KiB
// of the head's elements, a multiple of 4 rows. The hardware prefetchers stop at each 4 KiB page, which a head's K or V crosses
// every 8-16 rows, and a decode batch's attention streams every row's slot from DRAM (measured on a batch of cold
// slots: 2 KiB is too short for 512-dim int8 heads, 16 KiB gains nothing more).
inline int prefetch_ahead(int head_bytes) { return std::max(4, (8192 / head_bytes) & ~3); }

// A LinePrefetch over `rows` cache rows of this head from ring row `row` of the K or V plane (c.k or c.v), `bytes`
// each.
inline LinePrefetch head_rows(const uint8_t* plane, const AttnCache& c, int row, int rows, int bytes) {
  return LinePrefetch{plane + int64_t(row) * c.row_bytes + c.head_off, size_t(c.row_bytes), (bytes + 63) / 64, rows};
}

// f(std::integral_constant<int, n>, h0) for the blocks [h0, h0 + n) of NH heads: n = HB, then NH % HB for the rest.
template <int NH, int HB, class F>
inline void for_head_blocks(F&& f) {
  int h0 = 0;
  for (; h0 + HB <= NH; h0 += HB) f(std::integral_constant<int, HB>{}, h0);
  if constexpr (NH % HB != 0) f(std::integral_constant<int, NH % HB>{}, h0);
}

// The exponentials of one head's scores (sh, by position) times the softmax normaliser inv and, for int8 K/V (E, the
// bytes per cached element, 1), each position's V scale: the weights the P·V pass multiplies the V codes by.
template <int E>
inline void fold_weights(float* sh, const AttnCache& c, const Run* runs, int n_runs, float inv) {
  for (int ri = 0; ri < n_runs; ++ri) {
    float* w = sh + runs[ri].off;
    if constexpr (E != 1) {
      for (int i = 0; i < runs[ri].len; ++i) w[i] *= inv;
    } else {
      const float* vs = c.vs + runs[ri].row;
      for (int i = 0; i < runs[ri].len; ++i) w[i] *= vs[i] * inv;
    }
  }
}

// attend() over blocks of up to 8 heads, so each block reads (and converts) every K/V row once:
// Block<NH, E>::run(q, q_stride, hd, cache, lo, hi, out, out_stride, scratch, stats) attends NH heads whose cached
// elements are E bytes: int8 codes (1), f16 (2) or f32 (4). stats (null, or 2 floats a head: the largest score and
// the sum of exp(score - largest)) is for attending a part of the positions (ops.h attend_avx512_part).
template <template <int, int> class Block, int E>
inline void attend_heads(int nh, const float* qh, int q_stride, int hd, const AttnCache& c, int lo, int hi, float* oh,
                         int out_stride, float* scratch, float* stats) {
  switch (nh) {
    case 1: return Block<1, E>::run(qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, stats);
    case 2: return Block<2, E>::run(qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, stats);
    case 3: return Block<3, E>::run(qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, stats);
    case 4: return Block<4, E>::run(qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, stats);
    case 5: return Block<5, E>::run(qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, stats);
    case 6: return Block<6, E>::run(qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, stats);
    case 7: return Block<7, E>::run(qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, stats);
    default: return Block<8, E>::run(qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, stats);
  }
}

template <template <int, int> class Block>
inline void attend_in_blocks(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi,
                             float* out, int out_stride, float* scratch, float* stats = nullptr) {
  for (int h0 = 0; h0 < nq; h0 += 8) {
    const int nh = nq - h0 < 8 ? nq - h0 : 8;
    const float* qh = q + int64_t(h0) * q_stride;
    float* oh = out + int64_t(h0) * out_stride;
    float* st = stats ? stats + 2 * h0 : nullptr;
    if (c.ks) attend_heads<Block, 1>(nh, qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, st);
    else if (c.f32) attend_heads<Block, 4>(nh, qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, st);
    else attend_heads<Block, 2>(nh, qh, q_stride, hd, c, lo, hi, oh, out_stride, scratch, st);
  }
}

// The spans of a prefill block (ops.h attend_rows_avx512 / attend_rows_avx2): row r at position p0 + r attends
// [p0 + r - window + 1 (window > 0, at least 0), p0 + r].
inline void prefill_spans(const float* q, int q_row_stride, int rows, int p0, int window, float* out,
                          int out_row_stride, AttnSpanRow* spans) {
  for (int r = 0; r < rows; ++r) {
    const int pos = p0 + r;
    spans[r] = AttnSpanRow{q + int64_t(r) * q_row_stride, out + int64_t(r) * out_row_stride, nullptr,
                           window > 0 ? std::max(0, pos - window + 1) : 0, pos};
  }
}

// The union [*first, *last] of the rows' non-empty spans (*last = -1 when all are empty): the tiles a block walks.
inline void spans_union(const AttnSpanRow* rows, int n_rows, int* first, int* last) {
  *first = INT32_MAX, *last = -1;
  for (int r = 0; r < n_rows; ++r)
    if (rows[r].lo <= rows[r].hi) *first = std::min(*first, rows[r].lo), *last = std::max(*last, rows[r].hi);
}

// Vector v's (row v / nq, head v % nq) largest score m and sum of exponentials l, where its row asks for them.
inline void store_span_stats(const AttnSpanRow* rows, int nq, int v, float m, float l) {
  if (float* st = rows[v / nq].stats) {
    st[2 * (v % nq)] = m;
    st[2 * (v % nq) + 1] = l;
  }
}

// out[h * out_stride ..] = the n_parts parts of nq heads (parts[(p * nq + h) * hd ..], stats[(p * nq + h) * 2 ..])
// folded in order by fold (fold_part in ops_avx2.cpp, attend_fold_part in ops_avx512.cpp: out, out_stride, the
// running stats, a part, its stats, heads, hd), 8 heads at a time: attend_merge_parts_ymm / _avx512.
template <class Fold>
inline void merge_parts(const float* parts, const float* stats, int n_parts, int nq, int hd, float* out,
                        int out_stride, Fold fold) {
  for (int h = 0; h < nq; ++h) std::memcpy(out + int64_t(h) * out_stride, parts + int64_t(h) * hd, sizeof(float) * hd);
  float run[2 * 8];
  for (int h0 = 0; h0 < nq; h0 += 8) {
    const int nh = std::min(8, nq - h0);
    std::memcpy(run, stats + 2 * h0, sizeof(float) * 2 * nh);
    for (int p = 1; p < n_parts; ++p)
      fold(out + int64_t(h0) * out_stride, out_stride, run, parts + (int64_t(p) * nq + h0) * hd,
           stats + (int64_t(p) * nq + h0) * 2, nh, hd);
  }
}

}  // namespace
}  // namespace sg::ops
