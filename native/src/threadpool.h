// A persistent worker pool for the hot path: no thread creation, no allocation per call.
//
// run(n_tasks, fn) executes fn(task, worker) for task in [0, n_tasks) on the pool's workers
// (the calling thread is worker 0) and returns as soon as every task is done — it never waits for
// a worker that has not woken up yet (on a loaded machine that would tie every GEMM to the
// scheduler). Tasks are claimed from one atomic word holding (job generation, next task), so a
// worker that wakes late for a finished job can never run a task of the next one. A caller that
// wants a deterministic result must make each task write a disjoint part of the output (the
// GEMMs split N; nothing reduces across threads).
// Worker threads call the per-thread initialiser once at start (AMX tile permission is
// per thread).
//
// Waking a sleeping worker through the condition variable costs a futex call on the caller and
// tens of microseconds of scheduler latency before the worker runs; a decode step dispatches
// ~400 small jobs (the GEMMs of 35 layers, attention), back to back with microseconds between
// them, so a worker that went to sleep after each one left the caller streaming alone for part
// of every job. So a worker that finds no task may spin on the claim word for a while (spin_us;
// FGM_POOL_SPIN_US, default kDefaultSpinUs = 300; 0: sleep at once) before it sleeps,
// and the caller signals the condition variable only when a worker is asleep; the caller too
// spins that long for the last task to finish before it sleeps. The spin is bounded so an
// idle pool uses no CPU. On an oversubscribed machine spinning is a loss (the scheduler
// shares the CPU between threads, and a spinning thread spends its share on nothing: measured
// on the shared 2-core host at load 7-12, decode took 1.8x as long with an ungoverned spin), so
// each thread looks every 5 ms at the threads runnable on the machine (/proc/loadavg) and spins
// only while they are no more than the CPUs. Measured (docs/benchmarks.md): on the shared host
// (load 11-20, session 5) a 300 us spin ran decode B=1 at 0.88x of no spin; on the quiet host
// (session 6) it ran Gemma 3 270M decode B=1 at ~1.3x (four alternated pairs: 85-106 against
// 63-86 tok/s) and E2B's at 1.0x. Servers get dedicated cores, so the spin is on by default.
//
// Every task runs with denormal floats flushed to zero (MXCSR FTZ + DAZ): on Intel cores an
// operation that meets a denormal takes a microcode assist of ~100 cycles, and attention
// weights of far-away positions (exp of a very negative score, times a V scale) fall there
// often — measured on a 2-core Xeon with AMX, E2B prefill of 1024 tokens spent 4.96 s in
// attention with denormals and 0.48 s without (AMD cores take no such penalty). Workers set the
// mode once; run() sets it for the calling thread's share and restores the caller's mode after,
// so the same task gives the same bits whichever thread runs it, and code outside the pool
// (numpy in the same thread) keeps IEEE behaviour.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace sg {

// Sets (flush) or clears (IEEE denormals) FTZ + DAZ in this thread's MXCSR for the guard's lifetime. The pool's tasks
// flush; a task that must give the bits it gives outside the pool (sampling, whose reference is the caller's IEEE
// arithmetic) clears them for itself.
class ScopedDenormals {
 public:
  explicit ScopedDenormals(bool flush);
  ~ScopedDenormals();
  ScopedDenormals(const ScopedDenormals&) = delete;
  ScopedDenormals& operator=(const ScopedDenormals&) = delete;

 private:
  unsigned saved_;
};

class ThreadPool {
 public:
  using TaskFn = void (*)(void* ctx, int task, int worker);

  // n_threads includes the calling thread. thread_init runs once on every worker thread
  // (not on the caller, which must initialise itself).
  explicit ThreadPool(int n_threads, std::function<void()> thread_init = {}, int spin_us = -1);
  // What a spin_us of -1 means: FGM_POOL_SPIN_US when set (a non-negative integer; anything else throws
  // std::invalid_argument), else this many microseconds.
  static constexpr int kDefaultSpinUs = 300;
  static int default_spin_us();
  // Per thread: whether it may spin now (see above).
  class SpinGovernor {
   public:
    bool allowed();

   private:
    int64_t next_check_ns_ = 0;
    bool allowed_ = true;
  };
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  void run(int n_tasks, TaskFn fn, void* ctx);

  // Convenience for lambdas: the lambda lives on the caller's stack, nothing is allocated.
  template <class F>
  void parallel_for(int n_tasks, F&& f) {
    using Fn = std::remove_reference_t<F>;
    auto tramp = [](void* c, int task, int worker) { (*static_cast<Fn*>(c))(task, worker); };
    run(n_tasks, tramp, const_cast<void*>(static_cast<const void*>(&f)));
  }

 private:
  void worker_loop(int worker, std::function<void()> init);
  // Spins up to spin_us_ until pred() holds; returns whether it did.
  template <class P>
  bool spin_until(P&& pred, SpinGovernor& gov) const;
  // Claims and runs tasks of job `gen` until none is left (or another job has started).
  void drain(uint32_t gen, TaskFn fn, void* ctx, int n_tasks, int worker);

  int n_threads_;
  int spin_us_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_start_;
  std::condition_variable cv_done_;
  std::atomic<bool> stop_{false};
  // Current job, published under mu_. claim_ = (generation << 32) | next task index.
  uint32_t generation_ = 0;
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int n_tasks_ = 0;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};  // workers waiting on cv_start_ (changed under mu_)
  SpinGovernor caller_gov_;       // the calling thread's (run() has one caller at a time)
};

}  // namespace sg
