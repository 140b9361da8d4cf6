// A small thread pool of its own (no OpenMP: a process that also loads torch gets a second OpenMP runtime,
// and two runtimes spinning on two cores starve each other). `run(fn)` calls fn(tid, n) on n threads, the
// caller being thread 0. Inside fn the threads go through the same phases (`Phases`): each thread runs the
// chunks of its own contiguous share of a phase's work, then takes what is left of the others' shares, and a
// phase ends when every chunk is finished, not when every thread has arrived. So a thread the system has taken
// off its core (another busy process, a hypervisor's steal) holds the others up only while it holds a chunk;
// back on its core it runs through the phases the others finished. (With a fixed share and a barrier a phase,
// a pass on cores another busy process shares waited about one time slice at nearly every barrier: 8-80x its
// time alone.) Waiting spins briefly, then yields the core; idle workers sleep between runs, so the ONNX
// Runtime drafter sessions of the same process keep the cores to themselves. One pool per thread count serves
// the whole process (shared_pool).
#pragma once
#include <algorithm>
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
  explicit Pool(int n) : n_(n < 1 ? 1 : n), taken_(new Count[n < 1 ? 1 : n]) {
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
    // no worker is in a run now: every count starts again (published with the generation below)
    for (int t = 0; t < n_; ++t) taken_[t].n.store(0, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
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

  friend class Phases;

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
  const std::function<void(int, int)>* job_ = nullptr;
  // counted from the start of a run: per thread, the chunks of its shares handed out (to it or to another
  // thread); and the chunks finished
  struct alignas(64) Count {
    std::atomic<long> n{0};
  };
  std::unique_ptr<Count[]> taken_;
  alignas(64) std::atomic<long> finished_{0};
  bool stop_ = false;
};

// One thread's way through a run's phases. Every thread of the run makes the same calls with the same sizes, so
// each knows where every phase's counts start: thread j's share of phase k is the chunks [base_[j], base_[j] +
// its chunk count) of its count taken_[j], and the phase's chunks end at fbase_ + all chunks in finished_. A
// thread takes its own chunks in order, then the others' that are left; one still in an earlier phase finds
// them all taken and finished, and moves on at once. Which thread runs a chunk never changes what it computes.
class Phases {
 public:
  Phases(Pool& pool, int tid) : pool_(pool), tid_(tid), base_(pool.size(), 0) {}
  int tid() const { return tid_; }
  int threads() const { return pool_.size(); }

  // f(lo, hi) over [0, n), cut into min(n, per_thread x threads) contiguous chunks, thread j's share the j-th
  // run of them; returns when all are done.
  template <class F>
  void each(int n, int per_thread, F&& f) {
    const int nt = pool_.size();
    if (nt == 1) {
      if (n > 0) f(0, n);
      return;
    }
    const long chunks = std::min<long>(n, static_cast<long>(per_thread) * nt);
    if (chunks <= 0) return;
    long mine = 0;
    for (int k = 0; k < nt; ++k) {  // its own share first, then the next thread's, ...
      const int j = (tid_ + k) % nt;
      const long c0 = chunks * j / nt, end = base_[j] + chunks * (j + 1) / nt - c0;
      std::atomic<long>& taken = pool_.taken_[j].n;
      for (long v = taken.load(std::memory_order_relaxed); v < end;) {
        if (!taken.compare_exchange_weak(v, v + 1, std::memory_order_relaxed)) continue;
        const long c = c0 + v - base_[j];
        f(static_cast<int>(n * c / chunks), static_cast<int>(n * (c + 1) / chunks));
        ++mine;
        v = taken.load(std::memory_order_relaxed);
      }
    }
    if (mine) pool_.finished_.fetch_add(mine, std::memory_order_release);
    const long done = fbase_ + chunks;
    Pool::wait_until([&] { return pool_.finished_.load(std::memory_order_acquire) >= done; });
    fbase_ = done;
    for (int j = 0; j < nt; ++j) base_[j] += chunks * (j + 1) / nt - chunks * j / nt;
  }

 private:
  Pool& pool_;
  const int tid_;
  std::vector<long> base_;
  long fbase_ = 0;
};

}  // namespace spn
