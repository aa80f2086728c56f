// The emulated test build's driver: runs the VNNI and AMX backends (their AVX-512 and tile
// instructions replaced by the scalar stand-ins in this folder) against the real AVX2 backend
// on random int8/int4 weights and activations of many shapes, and the AVX-512 q8g kernels (f32
// and int8 activations) and the AMX q8g kernel against the AVX2 ones, and requires bit-identical output. Built and run
// by tests/test_kernels.py; prints one line per mismatch and a summary, exits non-zero on any
// mismatch.
//
//   harness <guard 0|1>     (SG_EMULATED_TILE_LOSS_EVERY=N simulates tile-state loss)
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gemm.h"
#include "kernels_impl.h"

using namespace sg;

namespace {

struct Shape {
  int n, k, group, hadamard;
  int m = 0;  // when set, only this many rows (instead of the row list)
};

template <class T>
T* aligned64(std::vector<T>& v) {
  uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((p + 63) / 64 * 64);
}

}  // namespace

int main(int argc, char** argv) {
  const int guard = argc > 1 ? std::atoi(argv[1]) : 0;
  detail::g_amx_guard.store(guard);
  const bool loss = std::getenv("SG_EMULATED_TILE_LOSS_EVERY") != nullptr;
  const std::vector<Shape> shapes = {{16, 64, 64, 0},     {48, 192, 64, 0},  {80, 384, 128, 128},
                                     {144, 768, 256, 128}, {112, 512, 128, 128}, {32, 4096, 4096, 0},
                                     // an output past kStreamOutputBytes (streaming stores), odd last row block
                                     {16400, 64, 64, 0, 81},
                                     // AMX q8c in K slices: two groups of row pairs, a partial last slice
                                     {48, 640, 128, 0, 300}};
  // 50 rows: the AMX q8c K-sliced path (≥ 2 row pairs) on the K > 512 shapes
  const std::vector<int> rows = loss ? std::vector<int>{1, 17, 33, 50} : std::vector<int>{1, 2, 3, 5, 8, 9, 15, 16, 17, 31, 32, 33, 50};
  std::mt19937 rng(20240607);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uni(-0.1f, 0.1f);
  int runs = 0, failures = 0;
  for (const Shape& sh : shapes)
    for (int m : sh.m ? std::vector<int>{sh.m} : rows)
      for (int q4 = 0; q4 < 2; ++q4) {
        std::vector<float> x(size_t(m) * sh.k);
        for (float& v : x) v = normal(rng);
        if (m > 2) std::fill(x.begin() + sh.k, x.begin() + 2 * sh.k, 0.f);  // an all-zero row
        std::vector<int8_t> packed(qact_packed_bytes(m, sh.k) + 64);
        std::vector<float> a_scale(qact_padded_rows(m));
        std::vector<int32_t> rowsum(qact_rowsum_count(m, sh.k));
        QAct a;
        a.packed = aligned64(packed);
        a.scale = a_scale.data();
        a.rowsum = rowsum.data();
        quantize_activations(x.data(), sh.k, m, sh.k, sh.hadamard, &a, nullptr);

        std::vector<uint8_t> codes(q4 ? size_t(sh.n) * sh.k / 2 : size_t(sh.n) * sh.k);
        for (uint8_t& c : codes) c = uint8_t(rng() & 0xFF);
        if (!q4)
          for (uint8_t& c : codes)
            if (c == 0x80) c = 0x81;  // int8 codes are in [-127, 127]
        std::vector<float> s8(sh.n);
        std::vector<uint16_t> s4(size_t(sh.k / sh.group) * sh.n);
        for (float& v : s8) v = uni(rng);
        for (uint16_t& v : s4) v = _cvtss_sh(uni(rng), 0);
        QLinear w;
        w.dtype = q4 ? DType::Q4G : DType::Q8C;
        w.n = sh.n;
        w.k = sh.k;
        w.group = q4 ? sh.group : 0;
        w.hadamard = sh.hadamard;
        w.codes = codes.data();
        w.scales = q4 ? static_cast<const void*>(s4.data()) : static_cast<const void*>(s8.data());

        // Outputs on cache lines, as the engine's are (the kernels stream large outputs only to aligned rows).
        std::vector<float> ba(size_t(m) * sh.n + 16, -1.f), bv(ba), bx(ba);
        float *ya = aligned64(ba), *yv = aligned64(bv), *yx = aligned64(bx);
        const size_t ybytes = size_t(m) * sh.n * sizeof(float);
        const int NB = sh.n / 16;
        for (int nb = 0; nb < NB; nb += detail::kTaskBlocks) {
          const int nb1 = nb + detail::kTaskBlocks < NB ? nb + detail::kTaskBlocks : NB;
          detail::gemm_avx2(a, w, ya, sh.n, nb, nb1);
          detail::gemm_vnni(a, w, yv, sh.n, nb, nb1);
          detail::gemm_amx(a, w, yx, sh.n, nb, nb1);
        }
        ++runs;
        const char* what = q4 ? "q4g" : "q8c";
        if (std::memcmp(ya, yv, ybytes)) {
          ++failures;
          std::printf("MISMATCH vnni %s n=%d k=%d group=%d m=%d\n", what, sh.n, sh.k, sh.group, m);
        }
        if (std::memcmp(ya, yx, ybytes)) {
          ++failures;
          std::printf("MISMATCH amx %s n=%d k=%d group=%d m=%d guard=%d\n", what, sh.n, sh.k, sh.group, m, guard);
        }
      }
  // q8g (weight-only, f32 activations): the zmm kernel of the VNNI/AMX hosts against the AVX2 one; with f32 scales,
  // and with f16 ones (QLinear::scales_f16), where the AVX2 kernels must also match themselves on f32 copies.
  const std::vector<Shape> q8g_shapes = {{16, 64, 64, 0}, {48, 640, 32, 0}, {272, 640, 16, 0}, {64, 2048, 32, 0},
                                         {32, 40, 8, 0},  {400, 96, 1, 0}, {32, 256, 128, 0}};
  for (const Shape& sh : q8g_shapes)
    for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 33, 40})
    for (bool with_offsets : {false, true})  // q8g, and q8ga (offsets)
    for (bool f16 : {false, true}) {
      // f16 scales on the row counts of each kernel's paths (one register block, several, the AMX stream, prefill)
      if (f16 && m != 1 && m != 5 && m != 9 && m != 13 && m != 33) continue;
      std::vector<float> x(size_t(m) * sh.k);
      for (float& v : x) v = normal(rng);
      std::vector<uint8_t> codes(size_t(sh.n) * sh.k);
      for (uint8_t& c : codes) c = uint8_t(rng() & 0xFF);
      for (uint8_t& c : codes)
        if (c == 0x80) c = 0x81;  // int8 codes are in [-127, 127]
      std::vector<float> scales(size_t(sh.k / sh.group) * sh.n);
      std::vector<uint16_t> scales16(scales.size());
      for (size_t i = 0; i < scales.size(); ++i) {
        scales16[i] = _cvtss_sh(uni(rng), 0);
        scales[i] = _cvtsh_ss(scales16[i]);  // the same values in f32
      }
      QLinear w;
      w.dtype = DType::Q8G;
      w.n = sh.n;
      w.k = sh.k;
      w.group = sh.group;
      w.codes = codes.data();
      w.scales = f16 ? static_cast<const void*>(scales16.data()) : static_cast<const void*>(scales.data());
      w.scales_f16 = f16;
      QLinear w32 = w;  // the f32 copy of the same scales
      w32.scales = scales.data();
      w32.scales_f16 = false;
      std::vector<float> offsets(scales.size());
      for (float& v : offsets) v = normal(rng);
      if (with_offsets) w.offsets = w32.offsets = offsets.data();
      std::vector<float> xsum(size_t(m) * (sh.k / sh.group));  // the group sums gemm_q8g passes with offsets
      detail::q8g_group_sums(x.data(), sh.k, m, sh.k, sh.group, xsum.data());
      const float* xs = with_offsets ? xsum.data() : nullptr;
      std::vector<float> ya(size_t(m) * sh.n, -1.f), yz(ya);
      detail::gemm_q8g_panels(x.data(), sh.k, m, w, xs, ya.data(), sh.n, 0, sh.n / 16);
      if (f16) {
        std::vector<float> y32(ya.size(), -4.f);
        detail::gemm_q8g_panels(x.data(), sh.k, m, w32, xs, y32.data(), sh.n, 0, sh.n / 16);
        ++runs;
        if (std::memcmp(ya.data(), y32.data(), ya.size() * sizeof(float))) {
          ++failures;
          std::printf("MISMATCH %s f16 scales avx2 n=%d k=%d group=%d m=%d\n", with_offsets ? "q8ga" : "q8g", sh.n,
                      sh.k, sh.group, m);
        }
      }
      // the zmm kernel on another split of the panels (its result must not depend on it either)
      for (int p = 0; p < sh.n / 16; p += 5)
        detail::gemm_q8g_panels_avx512(x.data(), sh.k, m, w, xs, yz.data(), sh.n, p, std::min(p + 5, sh.n / 16));
      ++runs;
      if (std::memcmp(ya.data(), yz.data(), ya.size() * sizeof(float))) {
        ++failures;
        std::printf("MISMATCH %s%s avx512 n=%d k=%d group=%d m=%d\n", with_offsets ? "q8ga" : "q8g",
                    f16 ? " f16 scales" : "", sh.n, sh.k, sh.group, m);
      }
      if (!q8g_runs_int8(w.k, w.group)) continue;
      // int8 activations: the VNNI kernel (vpdpbusd) against the AVX2 one (vpmaddubsw on the sign trick), each on
      // the activations laid out for its own register blocks, as gemm_q8g_multi quantises them
      // and the AMX kernel (tile products) on its row-after-row layout, padded to whole tiles (without tile-state
      // loss: it runs only where the guard is off)
      enum Layout { kAvx2, kZmm, kAmx };
      std::vector<float> yi(ya.size(), -1.f), yv(ya.size(), -2.f), yx(ya.size(), -3.f);
      for (Layout l : {kAvx2, kZmm, kAmx}) {
        if (l == kAmx && (guard || loss)) continue;
        const size_t rows = l == kAmx ? size_t(detail::q8g_amx_padded_rows(m)) : size_t(m);
        std::vector<int8_t> codes8(rows * sh.k);
        std::vector<float> ascale(size_t(m) * sh.k / 32);
        std::vector<int32_t> b16(size_t(m) * sh.k / 16), b32(size_t(m) * sh.k / 32);
        detail::Q8gActs a;
        a.m = m;
        a.k = sh.k;
        a.block_rows = l == kAmx ? 1 : detail::q8g_rows_per_block(m, detail::q8g_max_rows(l == kZmm, m));
        a.codes = codes8.data();
        a.scale = ascale.data();
        a.bias16 = b16.data();
        a.bias32 = b32.data();
        detail::q8g_quantize_rows(x.data(), sh.k, 0, m, a);
        for (int p = 0; p < sh.n / 16; p += 5) {
          const int p1 = std::min(p + 5, sh.n / 16);
          if (l == kZmm) detail::gemm_q8g_int8_panels_avx512(a, m, w, xs, yv.data(), sh.n, p, p1);
          if (l == kAmx) detail::gemm_q8g_int8_panels_amx(a, m, w, xs, yx.data(), sh.n, p, p1);
        }
        if (l == kAvx2) detail::gemm_q8g_int8_panels(a, m, w, xs, yi.data(), sh.n, 0, sh.n / 16);
        if (l == kAvx2 && f16) {
          std::vector<float> y32(yi.size(), -4.f);
          detail::gemm_q8g_int8_panels(a, m, w32, xs, y32.data(), sh.n, 0, sh.n / 16);
          ++runs;
          if (std::memcmp(yi.data(), y32.data(), yi.size() * sizeof(float))) {
            ++failures;
            std::printf("MISMATCH %s f16 scales int8 avx2 n=%d k=%d group=%d m=%d\n", with_offsets ? "q8ga" : "q8g",
                        sh.n, sh.k, sh.group, m);
          }
        }
      }
      ++runs;
      if (std::memcmp(yi.data(), yv.data(), yi.size() * sizeof(float))) {
        ++failures;
        std::printf("MISMATCH %s%s int8 avx512 n=%d k=%d group=%d m=%d\n", with_offsets ? "q8ga" : "q8g",
                    f16 ? " f16 scales" : "", sh.n, sh.k, sh.group, m);
      }
      if (!guard && !loss && std::memcmp(yi.data(), yx.data(), yi.size() * sizeof(float))) {
        ++failures;
        std::printf("MISMATCH %s%s int8 amx n=%d k=%d group=%d m=%d\n", with_offsets ? "q8ga" : "q8g",
                    f16 ? " f16 scales" : "", sh.n, sh.k, sh.group, m);
      }
    }
  std::printf("runs %d failures %d recoveries %llu\n", runs, failures,
              static_cast<unsigned long long>(detail::g_amx_recoveries.load()));
  return failures ? 1 : 0;
}
