#include "threadpool.h"

namespace sg {

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

void ThreadPool::drain(int worker) {
  for (;;) {
    int t = next_.fetch_add(1, std::memory_order_relaxed);
    if (t >= n_tasks_) break;
    fn_(ctx_, t, worker);
  }
}

void ThreadPool::run(int n_tasks, TaskFn fn, void* ctx) {
  if (n_tasks <= 0) return;
  if (n_threads_ == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; ++t) fn(ctx, t, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = fn;
    ctx_ = ctx;
    n_tasks_ = n_tasks;
    next_.store(0, std::memory_order_relaxed);
    active_ = n_threads_ - 1;
    ++generation_;
  }
  cv_start_.notify_all();
  drain(0);
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return active_ == 0; });
}

void ThreadPool::worker_loop(int worker, std::function<void()> init) {
  if (init) init();
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (stop_) return;
    }
    drain(worker);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--active_ == 0) cv_done_.notify_one();
    }
  }
}

}  // namespace sg
