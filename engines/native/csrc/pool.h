// A small thread pool of its own (no OpenMP: a process that also loads torch gets a second OpenMP runtime,
// and two runtimes spinning on two cores starve each other). `run(fn)` calls fn(tid, n) on n threads, the
// caller being thread 0; `barrier()` inside fn waits for all n. Waiting spins briefly, then yields the core
// (a sibling that was descheduled gets it back at once on a busy machine); idle workers sleep between runs,
// so the ONNX Runtime drafter sessions of the same process keep the cores to themselves. One pool per thread
// count serves the whole process (shared_pool).
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPN_PAUSE() _mm_pause()
#else
#define SPN_PAUSE() ((void)0)
#endif

namespace spn {

class Pool;
// The process's pool of `threads` threads, shared by every model and product that asks for that many (made
// on first use, freed with its last user). Two pools would each keep a spinning worker after its run, and
// on two cores the drafter's pass and the target's took the cores from each other.
std::shared_ptr<Pool> shared_pool(int threads);

class Pool {
 public:
  // Throws std::system_error when the system will not start a thread; the threads already started are
  // stopped and joined first (a joinable std::thread destroyed would terminate the process).
  explicit Pool(int n) : n_(n < 1 ? 1 : n) {
    try {
      workers_.reserve(n_ - 1);
      for (int t = 1; t < n_; ++t) workers_.emplace_back([this, t] { work(t); });
    } catch (...) {
      shutdown();
      throw;
    }
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() { shutdown(); }

  int size() const { return n_; }

  // One run at a time: models of one process share a pool (shared_pool), and their callers may be threads
  // of their own (a server's engine thread, a test's).
  void run(const std::function<void(int, int)>& fn) {
    std::lock_guard<std::mutex> one_at_a_time(run_mu_);
    if (n_ == 1) return fn(0, 1);
    job_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0, n_);
    wait_until([&] { return done_.load(std::memory_order_acquire) == n_ - 1; });
    job_ = nullptr;
  }

  void barrier() {
    if (n_ == 1) return;
    const unsigned sense = sense_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      sense_.store(sense + 1, std::memory_order_release);
      return;
    }
    wait_until([&] { return sense_.load(std::memory_order_acquire) != sense; });
  }

 private:
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

  template <class Ready>
  static void wait_until(Ready ready) {
    for (int i = 0; !ready(); ++i) {
      if (i < 4000) {
        SPN_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
  }

  void work(int tid) {
    unsigned long seen = 0;  // the generation before any run (a run may start before this thread does)
    for (;;) {
      // spin a little for the next pass (passes follow each other closely), then sleep
      for (int i = 0; i < 20000 && generation_.load(std::memory_order_acquire) == seen; ++i) SPN_PAUSE();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      (*job_)(tid, n_);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  const int n_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::mutex run_mu_;
  std::condition_variable cv_;
  std::atomic<unsigned long> generation_{0};
  std::atomic<int> done_{0};
  std::atomic<int> arrived_{0};
  std::atomic<unsigned> sense_{0};
  const std::function<void(int, int)>* job_ = nullptr;
  bool stop_ = false;
};

}  // namespace spn
