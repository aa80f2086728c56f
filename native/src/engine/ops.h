// Element-wise and attention kernels of the forward pass (everything but the GEMMs).
//
// Compiled in ops_avx2.cpp with -mavx2 -mfma -mf16c: call them only after cpu_has_avx2_fma_f16c() said yes (the
// Model constructor checks). The functions take raw pointers only, so no inline code compiled with those flags can
// leak into the rest of the library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sg::ops {

bool cpu_has_avx2_fma_f16c();  // defined in a baseline translation unit

// y = x * (mean(x^2) + eps)^-1/2 * w  (w == nullptr: no weight). y may equal x.
void rmsnorm(const float* x, const float* w, float* y, int n, float eps);
// h += rmsnorm(a) * w
void add_rmsnorm(float* h, const float* a, const float* w, int n, float eps);
void scale(float* x, int n, float s);
// g = gelu_tanh(g) * u
void gelu_mul(float* g, const float* u, int n);
// x = cap * tanh(x / cap)
void softcap(float* x, int n, float cap);
// Rotate-half RoPE of one head: pairs (d, d + half) for d < half, with per-pair cos/sin.
void rope(float* x, int half, const float* cos, const float* sin);
// Symmetric int8 of one row: scale = max|x| / 127 (0 for an all-zero row), code = round-half-even(x / scale).
void quantize_row_i8(const float* x, int n, int8_t* q, float* scale);
// One row to IEEE half precision (round to nearest even).
void store_row_f16(const float* x, int n, uint16_t* out);
// One row of a q4r gather table (64-code blocks, f16 scale per block) times mult.
void gather_q4r(const uint8_t* codes, const uint16_t* scales, int k, float mult, float* out);
// One row of a q8r gather table times (row scale * mult).
void gather_q8r(const int8_t* codes, float scale, int k, float mult, float* out);

// Row `lane` of one 16-row panel of a q8g table (docs/fgm-extensions.md): out[j] = code · s[j/group][row] · mult,
// where panel points at the panel's codes and scales at s[0][row] (f32, or f16 when scales_f16; stride n between
// groups); a q8ga table's offsets (f32, same layout; null for q8g) make it out[j] = (code · s + o) · mult, each step
// an f32 rounding.
void gather_q8g(const int8_t* panel, int lane, const void* scales, bool scales_f16, const float* offsets, int n,
                int group, int k, float mult, float* out);

// In-place orthonormal Walsh–Hadamard transform (H_block / √block, Sylvester order) of every block of `block` floats
// of x[0..n); block is a power of two dividing n (1: nothing to do). Applying it twice gives x back (up to rounding).
void fwht_blocks(float* x, int n, int block);
// The block the K/V cache is rotated in: the largest power of two dividing head_dim, at most 128.
int kv_rotation_block(int head_dim);

// The element-wise kernels of the forward pass as one table per instruction set: elementwise_avx2() holds the
// functions above (ymm, ops_avx2.cpp), elementwise_avx512() their zmm twins (elementwise_avx512.cpp, AVX-512F/BW/VL:
// call only when the CPU has AVX-512, i.e. on the VNNI and AMX backends). The zmm kernels give the ymm ones' bits
// (same IEEE operations per element, reductions in the ymm association; docs/engine-api.md).
struct Elementwise {
  void (*rmsnorm)(const float* x, const float* w, float* y, int n, float eps);
  void (*add_rmsnorm)(float* h, const float* a, const float* w, int n, float eps);
  void (*scale)(float* x, int n, float s);
  void (*gelu_mul)(float* g, const float* u, int n);
  void (*softcap)(float* x, int n, float cap);
  void (*quantize_row_i8)(const float* x, int n, int8_t* q, float* scale);
  void (*store_row_f16)(const float* x, int n, uint16_t* out);
  void (*fwht_blocks)(float* x, int n, int block);
  // One attention head in place: rmsnorm(x, w) over hd, rope with cos = cs[0..hd/2), sin = cs[hd/2..hd), then
  // fwht_blocks(x, hd, rot).
  void (*head_norm_rope)(float* x, const float* w, int hd, const float* cs, int rot, float eps);
  // One per-layer-input chunk (spec §3.1) in place: p = (rmsnorm(p * proj_scale, w) + g) * in_scale, each step an
  // f32 rounding.
  void (*ple_mix)(float* p, const float* g, const float* w, int n, float proj_scale, float in_scale, float eps);
};
const Elementwise& elementwise_avx2();
const Elementwise& elementwise_avx512();

// Attention of nq query heads that share one KV head, for one query row, over the cached positions
// [lo, hi] (hi = the query's own position): softmax(q . k) . v with k = code * kscale, v = code * vscale (int8) or
// the f16 or f32 values (ks, vs null), scale 1.0, fp32 softmax.
// Position p sits in cache row p % cap; rows are row_bytes apart and the KV head starts at byte head_off.
// A span of more than kAttendPartPositions positions is attended in attend_parts(span) parts folded in order (the
// zmm kernel's scheme, below), so attend_part of each part and attend_merge_parts_ymm give this call's bits.
// scratch holds max(nq * (hi - lo + 1), attend_avx512_scratch_floats(nq, hd)) floats.
struct AttnCache {
  const uint8_t* k;
  const uint8_t* v;
  const float* ks;  // null: f16 elements, or f32 ones when f32 is set
  const float* vs;
  int row_bytes, head_off, cap;
  bool f32 = false;
};
void attend(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi, float* out,
            int out_stride, float* scratch);
// attend() of one part [lo, hi] of a row's positions (one part whatever its length), its heads' stats (largest
// score, sum of exp(score - largest)) to stats[2 h], stats[2 h + 1]; attend_merge_parts_ymm folds parts laid out as
// attend_merge_parts_avx512's (below) with its arithmetic in ymm. The FGM_BACKEND=avx2 engine hands a single decode
// row's parts to different threads this way, and attends a row with a shared prefix this way where the tile kernel
// does not run: the prefix's positions from the prefix slot, the rest from the row's own slot.
void attend_part(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi, float* out,
                 int out_stride, float* scratch, float* stats);
void attend_merge_parts_ymm(const float* parts, const float* stats, int n_parts, int nq, int hd, float* out,
                            int out_stride);
// The same on zmm (ops_avx512.cpp): call only when the CPU has AVX-512 VNNI (the VNNI and AMX backends). f16 / f32
// K/V: equal to attend() up to f32 reassociation (relative ~1e-6); int8 K/V: Q·K in int8 and P·V in int16, within
// the bound ops_avx512.cpp states. Not bit for bit. Scratch: attend_avx512_scratch_floats(nq, hd) floats (a head_dim
// that is not a multiple of 16 runs attend(), with its scratch).
void attend_avx512(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi, float* out,
                   int out_stride, float* scratch);
// The zmm kernel attends a span of positions as attend_parts(span) parts of at most kAttendPartPositions, as equal
// as can be (part p starts at attend_part_start), each normalised within itself, folded in order into the result
// (attend_fold_part in ops_avx512.cpp: rescaled by l exp(m - m') per head). The parts depend on the span only, so
// single-stream decode can hand them to different threads (each reads and widens its share of the K/V once for all
// the group's heads) and give the bits of one attend_avx512 call: attend_avx512_part attends one part [lo, hi] (at
// most kAttendPartPositions positions, as its scratch holds) and stores head h's largest score and sum of
// exp(score - largest) in stats[2 h], stats[2 h + 1]; attend_merge_parts_avx512 folds n_parts of them in order,
// parts[p * nq * hd ..] the nq heads' outputs of part p (hd floats a head) and stats[p * nq * 2 ..] its stats, into
// out[h * out_stride ..]. hd % 16 == 0 for both.
constexpr int kAttendPartPositions = 256;
inline int attend_parts(int span) { return (span + kAttendPartPositions - 1) / kAttendPartPositions; }
inline int attend_part_start(int lo, int span, int p) { return lo + int(int64_t(span) * p / attend_parts(span)); }
// Scratch floats attend_avx512 and attend_avx512_part need for nq heads of hd (whatever the span).
inline size_t attend_avx512_scratch_floats(int nq, int hd) {
  return size_t(nq < 8 ? nq : 8) * (kAttendPartPositions + hd + 2);
}
void attend_avx512_part(const float* q, int q_stride, int nq, int hd, const AttnCache& c, int lo, int hi,
                        float* out, int out_stride, float* scratch, float* stats);
void attend_merge_parts_avx512(const float* parts, const float* stats, int n_parts, int nq, int hd, float* out,
                               int out_stride);

// Prefill attention of `rows` consecutive query rows of one sequence (positions p0 .. p0 + rows - 1, all of them
// already in the cache) × nq query heads sharing one KV head, against tiles of cached positions with an online
// softmax (attend_rows_avx512.cpp; docs/engine-api.md gives the design and the tolerance against attend()). Row r,
// head h reads q[r * q_row_stride + h * hd .. + hd) and writes out[r * out_row_stride + h * hd ..); row r attends
// [lo, p0 + r] with lo = max(0, p0 + r - window + 1) for window > 0, else 0. Requires hd % 32 == 0,
// rows * nq <= kAttendRowsVectors (kAttendRowsVectorsAmx with amx_tiles), cap * row_bytes < 2^31, and a CPU with
// AVX-512 VNNI (the vnni and amx backends'); scratch holds attend_rows_scratch_floats(rows * nq, hd) floats
// (attend_rows_scratch.h).
// amx_tiles: an int8 cache's dot products on AMX tiles (hd % 64 == 0; the same bits), where
// sg::amx_tiles_usable() said yes; an f16 cache's on bf16 tiles (hd % 64 == 0, within the f32 path's tolerance),
// where sg::amx_bf16_tiles_usable() says yes too.
//
// attend_spans_avx512 is the same kernel for query rows of different sequences: row r reads its nq heads' queries at
// rows[r].q (hd floats a head), attends [lo, hi] and writes the heads' normalised outputs to rows[r].out and, with
// rows[r].stats non-null, their stats there (2 floats a head, as attend_avx512_part), so attend_merge_parts_avx512
// folds the result with other parts. An empty span (lo > hi) gives zeros and the stats -inf, 0. The tiles stay on
// the absolute grid, so a row's result depends on its own span only, not on the rows beside it. Decode reads a
// shared prefix this way: the rows naming one prefix slot attend its positions in blocks, each K/V tile read and
// packed once per block instead of once per row (Model::attend_prefixed).
struct AttnSpanRow {
  const float* q;
  float* out;
  float* stats;
  int lo, hi;
};
constexpr int kAttendRowsVectors = 64;
// With amx_tiles the dot products cost little beside each K/V tile's packing, which a larger block shares among more
// vectors (xeon-amx-2c, E2B prefill 8192: attention 2.03 s at 64 vectors, 1.72 s at 256, 1.72 s at 512).
constexpr int kAttendRowsVectorsAmx = 256;
void attend_rows_avx512(const float* q, int q_row_stride, int rows, int nq, int hd, const AttnCache& c, int p0,
                        int window, float* out, int out_row_stride, float* scratch, bool amx_tiles = false);
void attend_spans_avx512(const AttnSpanRow* rows, int n_rows, int nq, int hd, const AttnCache& c, float* scratch,
                         bool amx_tiles = false);
// The same two on ymm for AVX2 hosts (attend_rows_avx2.cpp): f32 FMAs for every cache type (int8 codes too, scaled
// as attend() scales them), so within the f32 path's tolerance of attend(); hd % 16 == 0, the other requirements as
// above, and the same scratch (attend_rows_scratch_floats).
void attend_rows_avx2(const float* q, int q_row_stride, int rows, int nq, int hd, const AttnCache& c, int p0,
                      int window, float* out, int out_row_stride, float* scratch);
void attend_spans_avx2(const AttnSpanRow* rows, int n_rows, int nq, int hd, const AttnCache& c, float* scratch);

// Sampling helpers over a logits row. max_finite: the maximum, and whether every value is finite. exp_scan: the total
// of e_i = exp((x_i - max) * inv_t) in double, summed in blocks of kExpBlock ids (each block in four vector chains,
// then the blocks' totals in block order: fixed by n alone); block_totals (null, or exp_blocks(n) doubles) receives
// each block's total. exp_find: the draw's id for a target in [0, total): the running total over the blocks in order
// to the first block whose end exceeds the target, then that block's e_i one by one to the first id whose running
// total exceeds it (the block's last id where round-off leaves none, the row's last where no block's end does).
constexpr int kExpBlock = 64;
inline int exp_blocks(int n) { return (n + kExpBlock - 1) / kExpBlock; }
float max_finite(const float* x, int n, bool* all_finite);
double exp_scan(const float* x, int n, float max, float inv_t, double* block_totals);
int exp_find(const float* x, int n, float max, float inv_t, const double* block_totals, double target);
// exclude_below: every x_i < thr that is not `out` already becomes `out`; returns how many did. ids_not_equal:
// appends the ids i with x_i != out to ids, ascending.
int exclude_below(float* x, int n, float thr, float out);
void ids_not_equal(const float* x, int n, float out, std::vector<int>& ids);
// The k best ids of x[0..n) (no NaN), best first: by value, ties to the lower id; exactly a full sort's first k
// (0 < k <= n). A vector pass compares 8 values at a time with the k-th best so far, and only a value that can enter
// goes to a k-id heap: ~n/8 compares where a partial sort took ~n indirect ones (0.25-0.3 ms over a 262144-id row).
void best_k_ids(const float* x, int n, int k, int* out);

}  // namespace sg::ops
