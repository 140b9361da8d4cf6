// Memory for weights, on 2 MiB pages where the system gives them (madvise MADV_HUGEPAGE: Linux transparent huge
// pages in their "madvise" or "always" mode). A pass streams every weight once; on 4 KiB pages the ~96 MB of
// the default model's weights cost a TLB miss every 4 KiB, and its passes ran 5-10 % slower on an AVX2 Zen 3
// (docs/performance.md, "Weights on 2 MiB pages").
//
// Arrays are taken from chunks (mmap, each 2 MiB aligned, each twice the last up to 64 MiB, or what an array
// needs) and given back only all at once, when the arena is destroyed: an array replaced (a projection set
// twice) keeps its bytes until then. SPECRT_NATIVE_HUGE_PAGES=0 leaves the chunks on the system's default pages.
#pragma once
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace spn {

// Whether a new arena asks for huge pages: yes unless SPECRT_NATIVE_HUGE_PAGES=0 (read when each is made).
inline bool huge_pages_wanted() {
  const char* env = std::getenv("SPECRT_NATIVE_HUGE_PAGES");
  return !(env && std::strcmp(env, "0") == 0);
}

class Arena {
 public:
  static constexpr size_t kPage = size_t{2} << 20, kMaxChunk = size_t{64} << 20;

  explicit Arena(bool huge = huge_pages_wanted()) : huge_(huge) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (const Chunk& c : chunks_) munmap(c.raw, c.size);
  }

  // `bytes` (64-byte aligned, uninitialised); throws std::bad_alloc when the system has no more.
  void* take(size_t bytes) {
    bytes = std::max<size_t>((bytes + 63) / 64 * 64, 64);
    if (chunks_.empty() || used_ + bytes > cap_) grow(bytes);
    void* p = base_ + used_;
    used_ += bytes;
    taken_ += bytes;
    return p;
  }

  // Did the system accept the huge-page advice for every chunk (false: none asked for, or some refused)?
  bool advised() const { return !chunks_.empty() && advised_ == chunks_.size(); }
  size_t taken() const { return taken_; }

 private:
  struct Chunk {
    void* raw;
    size_t size;
  };

  void grow(size_t bytes) {
    const size_t size = std::max((bytes + kPage - 1) / kPage * kPage, next_);
    void* raw = mmap(nullptr, size + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    chunks_.push_back({raw, size + kPage});
    base_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kPage - 1) & ~uintptr_t{kPage - 1});
#ifdef MADV_HUGEPAGE
    if (huge_ && madvise(base_, size, MADV_HUGEPAGE) == 0) ++advised_;
#endif
    used_ = 0, cap_ = size, next_ = std::min(2 * size, kMaxChunk);
  }

  const bool huge_;
  std::vector<Chunk> chunks_;
  uint8_t* base_ = nullptr;
  size_t used_ = 0, cap_ = 0, next_ = kPage, taken_ = 0, advised_ = 0;
};

}  // namespace spn
