#include "threadpool.h"

#include <immintrin.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace sg {

namespace {
constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bit 15 flush-to-zero, bit 6 denormals-are-zero
}

ScopedDenormals::ScopedDenormals(bool flush) : saved_(_mm_getcsr()) {
  _mm_setcsr(flush ? saved_ | kFtzDaz : saved_ & ~kFtzDaz);
}
ScopedDenormals::~ScopedDenormals() { _mm_setcsr(saved_); }

int ThreadPool::default_spin_us() {
  const char* v = std::getenv("FGM_POOL_SPIN_US");
  if (!v || !*v) return kDefaultSpinUs;
  char* end = nullptr;
  const long us = std::strtol(v, &end, 10);
  if (*end || us < 0 || us > 1000000)
    throw std::invalid_argument(std::string("FGM_POOL_SPIN_US must be an integer in [0, 1000000], got '") + v + "'");
  return int(us);
}

ThreadPool::ThreadPool(int n_threads, std::function<void()> thread_init, int spin_us)
    : n_threads_(n_threads < 1 ? 1 : n_threads), spin_us_(spin_us < 0 ? default_spin_us() : spin_us) {
  for (int w = 1; w < n_threads_; ++w) threads_.emplace_back(&ThreadPool::worker_loop, this, w, thread_init);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

namespace {
constexpr int64_t kGovernorCheck = 5'000'000;  // ns between looks at the machine's runnable threads

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Threads runnable right now on the whole machine (the 4th field of /proc/loadavg, "running/total"), this one
// included; -1 when unknown.
int runnable_threads() {
  static const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[128];
  const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return -1;
  buf[n] = 0;
  const char* p = buf;
  for (int field = 0; field < 3 && p; ++field) p = std::strchr(p, ' '), p = p ? p + 1 : nullptr;
  return p ? std::atoi(p) : -1;
}

int online_cpus() {
  static const int n = int(sysconf(_SC_NPROCESSORS_ONLN));
  return n > 0 ? n : 1;
}
}  // namespace

bool ThreadPool::SpinGovernor::allowed() {
  const int64_t now = now_ns();
  if (now >= next_check_ns_) {
    next_check_ns_ = now + kGovernorCheck;
    const int running = runnable_threads();
    allowed_ = running < 0 || running <= online_cpus();
  }
  return allowed_;
}

template <class P>
bool ThreadPool::spin_until(P&& pred, SpinGovernor& gov) const {
  if (pred()) return true;
  if (spin_us_ == 0 || !gov.allowed()) return false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      _mm_pause();
      if (pred()) return true;
    }
    if (std::chrono::steady_clock::now() >= until) return false;
  }
}

void ThreadPool::drain(uint32_t gen, TaskFn fn, void* ctx, int n_tasks, int worker) {
  uint64_t w = claim_.load(std::memory_order_acquire);
  for (;;) {
    if (uint32_t(w >> 32) != gen) return;  // a newer job: not ours to touch
    const int task = int(uint32_t(w));
    if (task >= n_tasks) return;
    if (!claim_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    fn(ctx, task, worker);
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_tasks) {
      std::lock_guard<std::mutex> lk(mu_);  // pairs with the caller's wait
      cv_done_.notify_one();
    }
    w = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::run(int n_tasks, TaskFn fn, void* ctx) {
  if (n_tasks <= 0) return;
  ScopedDenormals flush(true);
  if (n_threads_ == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; ++t) fn(ctx, t, 0);
    return;
  }
  uint32_t gen;
  {
    // The job's fields and its generation change together under mu_, so a worker that reads them under mu_ never
    // pairs one job's generation with another's task count.
    std::lock_guard<std::mutex> lk(mu_);
    gen = ++generation_;
    fn_ = fn;
    ctx_ = ctx;
    n_tasks_ = n_tasks;
    done_.store(0, std::memory_order_relaxed);
    claim_.store(uint64_t(gen) << 32, std::memory_order_release);
  }
  // A worker counts itself in sleepers_ under mu_ before it waits, so after the lock above we see it.
  if (sleepers_.load(std::memory_order_relaxed) > 0) cv_start_.notify_all();
  drain(gen, fn, ctx, n_tasks, 0);
  if (spin_until([&] { return done_.load(std::memory_order_acquire) == n_tasks; }, caller_gov_)) return;
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == n_tasks; });
}

void ThreadPool::worker_loop(int worker, std::function<void()> init) {
  _mm_setcsr(_mm_getcsr() | kFtzDaz);  // for good: a worker runs nothing but tasks
  if (init) init();
  uint32_t seen = 0;
  SpinGovernor gov;
  for (;;) {
    // The spin watches the claim word (a hint); the job itself is read under mu_.
    spin_until([&] { return uint32_t(claim_.load(std::memory_order_acquire) >> 32) != seen ||
                            stop_.load(std::memory_order_relaxed); }, gov);
    uint32_t gen;
    TaskFn fn;
    void* ctx;
    int n;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (generation_ == seen && !stop_.load()) {
        sleepers_.fetch_add(1, std::memory_order_relaxed);
        cv_start_.wait(lk, [&] { return generation_ != seen || stop_.load(); });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (stop_.load()) return;
      seen = gen = generation_;
      fn = fn_;
      ctx = ctx_;
      n = n_tasks_;
    }
    drain(gen, fn, ctx, n, worker);
  }
}

}  // namespace sg
