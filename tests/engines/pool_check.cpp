// The native pool's phases (engines/native/csrc/pool.h), driven directly: tests/engines/test_pool.py compiles
// and runs this. Prints one line per failed check and exits 1; prints "ok" and exits 0 when all hold.
#include "pool.h"

#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

static int failures = 0;

static void expect(bool ok, const char* what, int a, int b) {
  if (!ok) {
    std::printf("FAILED %s (%d, %d)\n", what, a, b);
    ++failures;
  }
}

// Every item of every phase runs exactly once, for any size, chunking and thread count (more threads than
// cores included), and the chunks tile [0, n) without gaps or overlaps.
static void every_item_once() {
  for (int nt : {1, 2, 3, 4, 7}) {
    spn::Pool pool(nt);
    for (int n : {0, 1, 2, 5, 7, 16, 37, 100, 1000}) {
      for (int per : {1, 2, 4}) {
        std::vector<std::atomic<int>> hits(n);
        pool.run([&](int tid, int) {
          spn::Phases ph(pool, tid);
          for (int phase = 0; phase < 3; ++phase)
            ph.each(n, per, [&](int lo, int hi) {
              for (int i = lo; i < hi; ++i) hits[i].fetch_add(1);
            });
        });
        int wrong = 0;
        for (int i = 0; i < n; ++i) wrong += hits[i].load() != 3;
        expect(wrong == 0, "every item runs once a phase: threads, items", nt, n);
      }
    }
  }
}

// A phase ends when its chunks are finished, not when every thread has arrived: thread 1 is held until thread 0
// has gone through every phase alone, and then finds nothing left to do. (With a barrier a phase, this deadlocks.)
static void phases_end_without_a_thread_that_has_not_arrived() {
  spn::Pool pool(2);
  std::atomic<bool> released{false};
  std::atomic<int> total{0}, by_held{0};
  pool.run([&](int tid, int) {
    spn::Phases ph(pool, tid);
    if (tid == 1)
      while (!released.load()) std::this_thread::yield();
    for (int phase = 0; phase < 50; ++phase)
      ph.each(64, 4, [&](int lo, int hi) {
        total.fetch_add(hi - lo);
        if (tid == 1) by_held.fetch_add(hi - lo);
      });
    if (tid == 0) released.store(true);
  });
  expect(total.load() == 50 * 64, "thread 0 ran every item alone: items, expected", total.load(), 50 * 64);
  expect(by_held.load() == 0, "the held thread found nothing left: items it ran", by_held.load(), 0);
}

// Each phase reads what the one before wrote (whichever thread wrote it), over many runs, with threads that
// yield inside their chunks so that others take their shares: the result is the sequential one.
static void a_phase_sees_the_last_ones_writes() {
  const int n = 257, phases = 40;
  std::vector<long> want(n), a(n), b(n);
  for (int i = 0; i < n; ++i) want[i] = i;
  for (int k = 0; k < phases; ++k) {
    std::vector<long> next(n);
    for (int i = 0; i < n; ++i) next[i] = want[(i + 1) % n] + want[i] + 1;
    want.swap(next);
  }
  for (int nt : {2, 3, 4}) {
    spn::Pool pool(nt);
    for (int run = 0; run < 20; ++run) {
      for (int i = 0; i < n; ++i) a[i] = i;
      pool.run([&](int tid, int) {
        spn::Phases ph(pool, tid);
        for (int k = 0; k < phases; ++k) {
          std::vector<long>& src = k % 2 ? b : a;
          std::vector<long>& dst = k % 2 ? a : b;
          ph.each(n, 2, [&](int lo, int hi) {
            for (int i = lo; i < hi; ++i) {
              if ((i + tid + run) % 29 == 0) std::this_thread::yield();
              dst[i] = src[(i + 1) % n] + src[i] + 1;
            }
          });
        }
      });
      const std::vector<long>& got = phases % 2 ? b : a;
      int wrong = 0;
      for (int i = 0; i < n; ++i) wrong += got[i] != want[i];
      expect(wrong == 0, "phases in order: threads, wrong items", nt, wrong);
    }
  }
}

int main() {
  every_item_once();
  phases_end_without_a_thread_that_has_not_arrived();
  a_phase_sees_the_last_ones_writes();
  if (failures) return 1;
  std::printf("ok\n");
  return 0;
}
