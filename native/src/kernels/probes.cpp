// Peak and bandwidth probes (probes.h). Compiled with the AVX2 flags for the streaming read;
// the peak loops live in each backend's own translation unit.
#include "probes.h"

#include <immintrin.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "huge_pages.h"
#include "kernels_impl.h"

namespace sg {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

uint64_t (*peak_loop_for(Backend b))(uint64_t) {
  switch (b) {
    case Backend::Amx: return detail::peak_loop_amx;
    case Backend::Vnni: return detail::peak_loop_vnni;
    case Backend::Avx2: break;
  }
  return detail::peak_loop_avx2;
}

}  // namespace

namespace detail {
// Ten independent FMA chains: enough to cover the FMA latency (4-5 cycles) on two FMA ports.
uint64_t peak_loop_fma(uint64_t iters) {
  __m256 acc[10];
  for (int i = 0; i < 10; ++i) acc[i] = _mm256_set1_ps(float(i));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (uint64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 10; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 10; ++i) s = _mm256_add_ps(s, acc[i]);
  volatile float keep = _mm256_cvtss_f32(s);
  (void)keep;
  return iters * 10 * 8 * 2;
}
}  // namespace detail

namespace {

// Calibrates `loop` on one thread to about `seconds`, then runs it on every pool thread at once: operations / s.
double run_peak(uint64_t (*loop)(uint64_t), ThreadPool* pool, double seconds) {
  uint64_t iters = 1 << 14;
  for (;;) {
    const auto t0 = Clock::now();
    loop(iters);
    const double dt = seconds_since(t0);
    if (dt > 0.02) {
      iters = uint64_t(iters * (seconds / dt)) + 1;
      break;
    }
    iters *= 4;
  }
  const int n = pool ? pool->size() : 1;
  uint64_t ops[64] = {};
  auto task = [&](int t, int) {
    backend_thread_init();
    ops[t % 64] += loop(iters);
  };
  const auto t0 = Clock::now();
  detail::run_tasks(pool, n, task);
  const double dt = seconds_since(t0);
  uint64_t total = 0;
  for (uint64_t o : ops) total += o;
  return double(total) / dt;
}

}  // namespace

double peak_f32_gflops(Backend b, ThreadPool* pool, double seconds) {
  if (!cpu_supports(b))
    throw std::runtime_error(std::string("peak_f32_gflops: this CPU cannot run the ") + backend_name(b) + " backend");
  return run_peak(b == Backend::Avx2 ? detail::peak_loop_fma : detail::peak_loop_fma512, pool, seconds) / 1e9;
}

double peak_tops(Backend b, ThreadPool* pool, double seconds) {
  if (!cpu_supports(b)) throw std::runtime_error(std::string("peak_tops: this CPU cannot run the ") + backend_name(b) + " backend");
  backend_thread_init();
  return run_peak(peak_loop_for(b), pool, seconds) / 1e12;
}

double amx_tile_loop_tops(int in_l1, ThreadPool* pool, double seconds) {
  if (!cpu_supports(Backend::Amx)) throw std::runtime_error("amx_tile_loop_tops: this CPU cannot run the amx backend");
  if (in_l1 < 0 || in_l1 > 3)
    throw std::invalid_argument("amx_tile_loop_tops: in_l1 must be 0-3, got " + std::to_string(in_l1));
  backend_thread_init();
  return run_peak(detail::tile_loop_amx_fns[in_l1], pool, seconds) / 1e12;
}

namespace {
// Each thread's share of `bytes`, in whole pages; checks the arguments of both probes.
size_t bandwidth_slice(size_t bytes, int threads, int passes) {
  if (passes < 1) throw std::invalid_argument("read_bandwidth_gbs: passes must be at least 1");
  const size_t slice = (bytes / threads) / 4096 * 4096;
  if (slice == 0) throw std::invalid_argument("read_bandwidth_gbs: buffer too small");
  return slice;
}
}  // namespace

std::vector<double> read_bandwidth_gbs(const void* data, size_t bytes, ThreadPool* pool, int passes) {
  const int n = pool ? pool->size() : 1;
  const size_t slice = bandwidth_slice(bytes, n, passes);
  const uint8_t* base = static_cast<const uint8_t*>(data);
  uint64_t sink[64] = {};
  auto read = [&](int t, int) {
    // 32-byte loads from wherever the slice starts: a mapped file's pages are 4 KB-aligned, a caller's buffer need
    // not be.
    const uint8_t* p = base + slice * t;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < slice; i += 128) {
      a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
      a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
      a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
      a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    sink[t % 64] += uint64_t(_mm256_extract_epi64(s, 0));
  };
  std::vector<double> gbs;
  for (int i = 0; i < passes; ++i) {
    const auto t0 = Clock::now();
    detail::run_tasks(pool, n, read);
    gbs.push_back(double(slice) * n / seconds_since(t0) / 1e9);
  }
  volatile uint64_t keep = sink[0];
  (void)keep;
  return gbs;
}

std::vector<double> read_bandwidth_gbs(size_t bytes, ThreadPool* pool, int passes) {
  const int n = pool ? pool->size() : 1;
  const size_t slice = bandwidth_slice(bytes, n, passes);
  // On huge pages where the kernel gives them (huge_pages.h), as the weights the decode steps stream are mapped:
  // on 4 KB pages this probe read 1.5x slower than the model file's 2 MB folios on a KVM guest, and understated
  // the limit decode is compared with.
  const size_t bytes_all = slice * n;
  const auto release = [bytes_all](uint8_t* p) { stream_free(p, bytes_all); };
  std::unique_ptr<uint8_t, decltype(release)> buf(static_cast<uint8_t*>(stream_alloc(bytes_all)), release);
  // Touch every page on the thread that will read it (first-touch placement).
  auto touch = [&](int t, int) { std::memset(buf.get() + slice * t, t + 1, slice); };
  detail::run_tasks(pool, n, touch);
  return read_bandwidth_gbs(buf.get(), slice * n, pool, passes);
}

}  // namespace sg
