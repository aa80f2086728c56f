// Activation preparation shared by every backend: Hadamard transform, per-row int8
// quantisation, packing into the A-tile layout (gemm.h). One implementation for all backends
// is what makes their inputs identical. Compiled with -mavx2 -mfma -mf16c: AVX2 is the floor
// of every backend, and active_backend() refuses to run on a CPU without it.
#include <immintrin.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "gemm.h"
#include "kernels_impl.h"
#include "quantize_row.h"
#include "quotient_codes.h"

namespace sg {
namespace {

constexpr float kInvSqrt128 = 0.08838834764831845f;  // 1/√128 rounded to f32

// One butterfly stage inside each ymm: lanes with bit `stride` clear get x[i] + x[i^stride],
// the others x[i^stride] − x[i] (i.e. a − b of the pair (a, b)).
template <int kBlend>
inline __m256 in_lane_stage(__m256 x, __m256 swapped) {
  return _mm256_blend_ps(_mm256_add_ps(x, swapped), _mm256_sub_ps(swapped, x), kBlend);
}

// x·H on 128 floats: strides 1, 2, 4 inside each ymm, then 8, 16, 32 among groups of 8 ymm,
// then 64 between the halves, with the 1/√128 folded into that last stage. Each pass keeps at
// most 8 vectors live (no spills) and goes through dst, which stays in L1.
inline void fwht_block(const float* src, float* dst) {
  for (int i = 0; i < 16; ++i) {
    __m256 x = _mm256_loadu_ps(src + 8 * i);
    x = in_lane_stage<0xAA>(x, _mm256_permute_ps(x, 0xB1));
    x = in_lane_stage<0xCC>(x, _mm256_permute_ps(x, 0x4E));
    x = in_lane_stage<0xF0>(x, _mm256_permute2f128_ps(x, x, 1));
    _mm256_storeu_ps(dst + 8 * i, x);
  }
  for (int h = 0; h < 2; ++h) {
    __m256 v[8];
    for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(dst + 64 * h + 8 * i);
    for (int s = 1; s < 8; s <<= 1)
      for (int i = 0; i < 8; ++i)
        if (!(i & s)) {
          const __m256 a = v[i], b = v[i + s];
          v[i] = _mm256_add_ps(a, b);
          v[i + s] = _mm256_sub_ps(a, b);
        }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + 64 * h + 8 * i, v[i]);
  }
  const __m256 norm = _mm256_set1_ps(kInvSqrt128);
  for (int i = 0; i < 8; ++i) {
    const __m256 a = _mm256_loadu_ps(dst + 8 * i), b = _mm256_loadu_ps(dst + 64 + 8 * i);
    _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(_mm256_add_ps(a, b), norm));
    _mm256_storeu_ps(dst + 64 + 8 * i, _mm256_mul_ps(_mm256_sub_ps(a, b), norm));
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float amax_of(const float* p, int n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(p + i), abs_mask));
  return hmax(m);
}

// 64 floats → 64 int8 codes at dst (one A-tile row); returns their sum.
inline int32_t quantize64(const float* p, const detail::QuotientCodes256& codes, int8_t* dst) {
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i q[8];
  __m256i sum = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    // round-half-even(fl(x / scale)) (quotient_codes.h), then the clamp to ±127.
    __m256i v = codes(_mm256_loadu_ps(p + 8 * j));
    v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
    sum = _mm256_add_epi32(sum, v);
    q[j] = v;
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int h = 0; h < 2; ++h) {
    const __m256i p01 = _mm256_packs_epi32(q[4 * h], q[4 * h + 1]);
    const __m256i p23 = _mm256_packs_epi32(q[4 * h + 2], q[4 * h + 3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * h), b);
  }
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

struct Isa {
  static void fwht_block(const float* src, float* dst) { sg::fwht_block(src, dst); }
  static float amax_of(const float* p, int n) { return sg::amax_of(p, n); }
  static int32_t quantize64(const float* p, float scale, int8_t* dst) {
    return sg::quantize64(p, detail::QuotientCodes256(scale), dst);
  }
};

void quantize_row(const float* x, int k, int hadamard, int row, QAct* out) {
  detail::quantize_row_with<Isa>(x, k, hadamard, row, out);
}

}  // namespace

void fwht128(float* x, int n) {
  if (n % 128 != 0) throw std::invalid_argument("fwht128: length " + std::to_string(n) + " is not a multiple of 128");
  for (int b = 0; b < n; b += 128) fwht_block(x + b, x + b);
}

namespace detail {

void quantize_rows(const float* x, int ldx, const RowSource* src, int m, int k, int hadamard, QAct* out,
                   ThreadPool* pool, QuantizeRowFn quantize_one) {
  if (m < 0 || k <= 0 || k % 64 != 0)
    throw std::invalid_argument("quantize_activations: need m >= 0 and k a positive multiple of 64 (m=" +
                                std::to_string(m) + ", k=" + std::to_string(k) + ")");
  if (hadamard != 0 && (hadamard != 128 || k % 128 != 0))
    throw std::invalid_argument("quantize_activations: hadamard must be 0, or 128 with k % 128 == 0 (hadamard=" +
                                std::to_string(hadamard) + ", k=" + std::to_string(k) + ")");
  if (!src && ldx < k) throw std::invalid_argument("quantize_activations: ldx < k");
  if (src && k > kRowSourceMaxK)
    throw std::invalid_argument("quantize_activations_from: k = " + std::to_string(k) + " is above " +
                                std::to_string(kRowSourceMaxK));
  if (!out || !out->packed || !out->scale || !out->rowsum)
    throw std::invalid_argument("quantize_activations: output buffers not set");
  out->m = m;
  out->k = k;
  out->hadamard = hadamard;
  const int rows = qact_padded_rows(m);
  // Rows are independent, so any split is deterministic; 4 rows per task keeps the
  // hand-out overhead small at decode sizes.
  const int per_task = 4;
  auto task = [&](int t, int) {
    alignas(64) float made[kRowSourceMaxK];  // a made row: L1-resident between its producer and the quantiser
    for (int r = t * per_task; r < (t + 1) * per_task && r < rows; ++r) {
      if (r >= m) {
        // A padding row: scale and rowsum 0, its codes left as they are (gemm.h). Zeroing them cost a single-row
        // decode step 15 rows of k bytes a GEMM input, ~0.3 ms of a 31 ms E2B step (Zen 5).
        std::fill_n(out->rowsum + (size_t)r * (k / 64), k / 64, 0);
        out->scale[r] = 0.f;
        continue;
      }
      if (src) src->fill(src->ctx, r, made);
      quantize_one(src ? made : x + (size_t)r * ldx, k, hadamard, r, out);
    }
  };
  const int n_tasks = (rows + per_task - 1) / per_task;
  run_tasks(m * (size_t)k >= 16384 ? pool : nullptr, n_tasks, task);
}

}  // namespace detail

void quantize_activations(const float* x, int ldx, int m, int k, int hadamard, QAct* out, ThreadPool* pool) {
  detail::quantize_rows(x, ldx, nullptr, m, k, hadamard, out, pool, quantize_row);
}

void quantize_activations_from(const RowSource& src, int m, int k, int hadamard, QAct* out, ThreadPool* pool) {
  detail::quantize_rows(nullptr, 0, &src, m, k, hadamard, out, pool, quantize_row);
}

}  // namespace sg
