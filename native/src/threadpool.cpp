#include "threadpool.h"

#include <xmmintrin.h>

namespace sg {

namespace {
constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bit 15 flush-to-zero, bit 6 denormals-are-zero
}

ScopedFlushDenormals::ScopedFlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtzDaz); }
ScopedFlushDenormals::~ScopedFlushDenormals() { _mm_setcsr(saved_); }

ThreadPool::ThreadPool(int n_threads, std::function<void()> thread_init) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  for (int w = 1; w < n_threads_; ++w) threads_.emplace_back(&ThreadPool::worker_loop, this, w, thread_init);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    ++generation_;
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
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
  ScopedFlushDenormals flush;
  if (n_threads_ == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; ++t) fn(ctx, t, 0);
    return;
  }
  uint32_t gen;
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen = ++generation_;
    fn_ = fn;
    ctx_ = ctx;
    n_tasks_ = n_tasks;
    done_.store(0, std::memory_order_relaxed);
    claim_.store(uint64_t(gen) << 32, std::memory_order_release);
  }
  cv_start_.notify_all();
  drain(gen, fn, ctx, n_tasks, 0);
  if (done_.load(std::memory_order_acquire) == n_tasks) return;
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == n_tasks; });
}

void ThreadPool::worker_loop(int worker, std::function<void()> init) {
  _mm_setcsr(_mm_getcsr() | kFtzDaz);  // for good: a worker runs nothing but tasks
  if (init) init();
  uint32_t seen = 0;
  for (;;) {
    uint32_t gen;
    TaskFn fn;
    void* ctx;
    int n;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return generation_ != seen || stop_; });
      if (stop_) return;
      seen = gen = generation_;
      fn = fn_;
      ctx = ctx_;
      n = n_tasks_;
    }
    drain(gen, fn, ctx, n, worker);
  }
}

}  // namespace sg
