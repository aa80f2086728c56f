// Two builds of the VNNI GEMM kernel (gemm_vnni.cpp) in ONE process, alternated call by call: on a shared host the
// load changes from second to second, so separate processes (or blocks of calls) compare the load as much as the
// code. Arm "base:DTYPE" is the base tree's kernel (its gemm_vnni renamed gemm_vnni_base by run.sh), "new:DTYPE" this
// tree's, "peak" the vpdpbusd peak loop on both threads; DTYPE is q4g (group 256) or q8c. Every call reads the next
// copy of a ~200 MB weight set shared by the arms of that dtype, so each call streams from DRAM, as decode does.
// Before timing, base and new must give the same bits (or it exits 1). Prints per arm the median and 10th percentile
// of the call times (the 10th percentile: the least disturbed calls). Dispatch as gemm_multi does: 2 pool threads,
// tasks of detail::task_blocks() 16-column blocks (TB=n overrides; an arm "new:q4g:16" takes tasks of 16 blocks).
// COPIES=n sets the number of weight copies (1: the same weights every call, cached when they fit: the kernel's rate
// without the DRAM stream).
//   bench/ab_gemm_vnni/run.sh /work/main  M N K CALLS_PER_ARM ARM...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gemm.h"
#include "kernels_impl.h"

namespace sg {
// backend.cpp's, without linking the dispatcher.
size_t qact_packed_bytes(int m, int k) { return (size_t)qact_padded_rows(m) * (size_t)k; }
size_t qact_rowsum_count(int m, int k) { return (size_t)qact_padded_rows(m) * (size_t)(k / 64); }
int qact_padded_rows(int m) { return (m + 15) / 16 * 16; }
namespace detail {
void gemm_vnni_base(const QAct&, const QLinear&, float*, int, int, int);
}
}  // namespace sg

using namespace sg;
using Kernel = void (*)(const QAct&, const QLinear&, float*, int, int, int);

struct Weights {
  bool q4 = false;
  size_t code_bytes = 0, scale_bytes = 0;
  int copies = 1;
  std::vector<uint8_t> codes, scales;
};

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s M N K CALLS ARM... (ARM: base:q4g new:q4g base:q8c new:q8c peak)\n", argv[0]);
    return 2;
  }
  const int M = std::atoi(argv[1]), N = std::atoi(argv[2]), Kd = std::atoi(argv[3]), calls = std::atoi(argv[4]);
  struct Arm { int kernel; bool q4; int tb; };  // kernel 0 base, 1 new, 2 peak; tb: column blocks a task
  std::vector<Arm> arms;
  const int tb = std::getenv("TB") ? std::atoi(std::getenv("TB")) : detail::task_blocks(M, N / 16, 2);
  for (int i = 5; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "peak") {
      arms.push_back({2, false, tb});
      continue;
    }
    const size_t c1 = s.find(':'), c2 = s.find(':', c1 + 1);  // KERNEL:DTYPE[:TB]
    arms.push_back({s.rfind("new:", 0) == 0 ? 1 : 0, s.compare(c1 + 1, 3, "q4g") == 0,
                    c2 == std::string::npos ? tb : std::atoi(s.c_str() + c2 + 1)});
  }
  std::mt19937 rng(1);
  Weights ws[2];
  for (int q = 0; q < 2; ++q) {
    Weights& w = ws[q];
    w.q4 = q;
    w.code_bytes = q ? (size_t)N * Kd / 2 : (size_t)N * Kd;
    w.scale_bytes = q ? (size_t)(Kd / 256) * N * 2 : (size_t)N * 4;
    const char* copies = std::getenv("COPIES");
    w.copies = copies && *copies ? std::atoi(copies)
                                 : (int)std::max<size_t>(1, (200u << 20) / (w.code_bytes + w.scale_bytes));
    if (w.copies < 1) {
      std::fprintf(stderr, "COPIES must be a positive count, got '%s'\n", copies);
      return 2;
    }
    w.codes.resize(w.code_bytes * w.copies + 8192);  // + the prefetch's reach past the last copy
    w.scales.resize(w.scale_bytes * w.copies + 64);
    for (auto& c : w.codes) c = uint8_t(rng());
    if (q) {
      auto* s = reinterpret_cast<uint16_t*>(w.scales.data());
      for (size_t i = 0; i < w.scale_bytes * w.copies / 2; ++i) s[i] = uint16_t(0x2000 + (rng() & 0x3ff));
    } else {
      auto* s = reinterpret_cast<float*>(w.scales.data());
      for (size_t i = 0; i < w.scale_bytes * w.copies / 4; ++i) s[i] = 1e-3f * float(1 + (rng() & 7));
    }
  }
  std::vector<int8_t> packed(qact_packed_bytes(M, Kd));
  std::vector<float> a_scale(qact_padded_rows(M), 0.01f);
  std::vector<int32_t> rowsum(qact_rowsum_count(M, Kd));
  for (auto& v : packed) v = int8_t(int(rng() % 255) - 127);
  for (int m = 0; m < qact_padded_rows(M); ++m)  // consistent per-64-block sums, as quantize_activations makes them
    for (int kb = 0; kb < Kd / 64; ++kb) {
      int32_t s = 0;
      for (int k = 0; k < 64; ++k) s += packed[((size_t)(m / 16) * (Kd / 64) + kb) * 1024 + (m % 16) * 64 + k];
      rowsum[(size_t)m * (Kd / 64) + kb] = s;
    }
  QAct a;
  a.m = M, a.k = Kd, a.hadamard = 128, a.packed = packed.data(), a.scale = a_scale.data(), a.rowsum = rowsum.data();
  std::vector<float> y0((size_t)M * N), y1((size_t)M * N);
  ThreadPool pool(2);
  const Kernel kernels[2] = {detail::gemm_vnni_base, detail::gemm_vnni};
  auto run = [&](int kernel, Weights& wt, int copy, float* y, int tb) {
    QLinear w;
    w.dtype = wt.q4 ? DType::Q4G : DType::Q8C, w.n = N, w.k = Kd, w.group = wt.q4 ? 256 : 0, w.hadamard = 128;
    w.codes = wt.codes.data() + wt.code_bytes * copy;
    w.scales = wt.scales.data() + wt.scale_bytes * copy;
    const int NB = N / 16, tasks = (NB + tb - 1) / tb;
    const Kernel f = kernels[kernel];
    pool.parallel_for(tasks, [&](int t, int) { f(a, w, y, N, t * tb, std::min(NB, t * tb + tb)); });
  };
  for (int q = 0; q < 2; ++q) {
    run(0, ws[q], 0, y0.data(), tb);
    run(1, ws[q], 0, y1.data(), tb);
    if (std::memcmp(y0.data(), y1.data(), y0.size() * sizeof(float))) {
      std::printf("MISMATCH between base and new (%s)\n", q ? "q4g" : "q8c");
      return 1;
    }
  }
  constexpr uint64_t kPeakIters = 20000;
  std::vector<std::vector<double>> t(arms.size());
  int next_copy[2] = {0, 0};
  for (int r = 0; r < calls; ++r)
    for (size_t i = 0; i < arms.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (arms[i].kernel == 2) pool.parallel_for(2, [&](int, int) { detail::peak_loop_vnni(kPeakIters); });
      else {
        Weights& w = ws[arms[i].q4];
        run(arms[i].kernel, w, next_copy[arms[i].q4]++ % w.copies, y0.data(), arms[i].tb);
      }
      t[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  std::printf("M=%d N=%d K=%d, %d calls per arm\n", M, N, Kd, calls);
  double first = 0;
  for (size_t i = 0; i < arms.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    const double med = t[i][t[i].size() / 2], p10 = t[i][t[i].size() / 10];
    if (arms[i].kernel == 2) {
      const double ops = 2.0 * kPeakIters * 12 * 128;
      std::printf("  peak            %.3f TOPS (p10 %.3f)\n", ops / med / 1e12, ops / p10 / 1e12);
      continue;
    }
    if (first == 0) first = med;
    const Weights& w = ws[arms[i].q4];
    const double ops = 2.0 * M * N * Kd, bytes = double(w.code_bytes + w.scale_bytes);
    std::printf("  %s:%s:%-3d  %9.1f us  %6.1f GB/s  %.3f TOPS  (%.2f of the first arm)  p10 %9.1f us %.3f TOPS\n",
                arms[i].kernel ? "new " : "base", w.q4 ? "q4g" : "q8c", arms[i].tb, med * 1e6, bytes / med / 1e9,
                ops / med / 1e12, med / first, p10 * 1e6, ops / p10 / 1e12);
  }
}
