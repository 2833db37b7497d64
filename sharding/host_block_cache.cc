// The host block cache (sharding/host_memory.h): LibTorch's CPU allocator
// for blocks of 1 MiB and more, keeping freed pages for reuse by later
// blocks of any size, never more resident than the peak of live bytes since
// the last release.
//
// Every block is an anonymous mapping of its own: whole 1 MiB chunks, then a
// tail of whole pages. A freed block waits whole for a request of its size
// (reused as it is, no system call). A request of another size takes the
// cache's pages instead: the oldest freed blocks are broken into their chunks
// and tails, and mremap(2) moves them, page tables only, into a new mapping:
// a chunk into each of its chunk slots, and into its tail the front of the
// smallest cached piece that holds it (a block's tail or what an earlier
// split left, else a chunk), the rest of that piece staying cached. Only what
// they cannot fill is fresh memory, faulted in when first touched.
//
// mremap moves only pages of one mapping. A new block's mappings meet only
// at its chunk boundaries and where its tail starts, and pieces are split
// only inside themselves, so every cached chunk, tail and piece lies within
// one mapping.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/errors.h"
#include "base/logging.h"
#include "sharding/host_memory.h"
#include "sharding/internal/malloc_heap.h"

namespace shardtrain::sharding {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kChunk = static_cast<size_t>(kHostBlockCacheMinBytes);

size_t RoundUpToPages(size_t n) { return (n + kPage - 1) / kPage * kPage; }

// SHARDTRAIN_HOST_CACHE: unset or "1" (cache), "0" (off).
bool CacheWanted() {
  const char* v = std::getenv("SHARDTRAIN_HOST_CACHE");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "1") == 0) return true;
  ST_CHECK_ARG(std::strcmp(v, "0") == 0, "SHARDTRAIN_HOST_CACHE='", v,
               "' is not valid: 1 (keep freed host blocks for reuse, the default) or 0 (LibTorch's own allocator)");
  return false;
}

struct Range {
  char* ptr;
  size_t bytes;
};

class HostBlockCache final : public c10::Allocator {
 public:
  explicit HostBlockCache(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < kChunk) return inner_->allocate(n);
    const size_t bytes = RoundUpToPages(n);
    char* ptr = TakeWhole(bytes);
    if (ptr == nullptr) ptr = Assemble(bytes);
    c10::profiledCPUMemoryReporter().New(ptr, bytes);
    return c10::DataPtr(ptr, ptr, &Free, c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // A block's storage was freed: it waits whole for a request of its size.
  void Return(void* ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = lent_.find(ptr);
    if (it == lent_.end()) {
      ReturnForeign(ptr);
      return;
    }
    const size_t bytes = it->second;
    lent_.erase(it);
    // Before another request can take the block (the profiler keys by pointer).
    c10::profiledCPUMemoryReporter().Delete(ptr);
    live_ -= static_cast<int64_t>(bytes);
    cached_ += static_cast<int64_t>(bytes);
    lru_.push_back(Range{static_cast<char*>(ptr), bytes});
    whole_[bytes].push_back(std::prev(lru_.end()));
  }

  void Release() {
    std::vector<Range> unmap;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Range& r : lru_) GiveBack(r, &unmap);
      for (char* c : loose_) GiveBack(Range{c, kChunk}, &unmap);
      for (const auto& [bytes, piece] : tails_) GiveBack(Range{piece, bytes}, &unmap);
      lru_.clear();
      whole_.clear();
      loose_.clear();
      tails_.clear();
      peak_ = live_;
      ++stats_.releases;
    }
    Unmap(unmap);
  }

  HostCacheStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    HostCacheStats s = stats_;
    s.installed = true;
    s.live_bytes = live_;
    s.cached_bytes = cached_;
    s.peak_bytes = peak_;
    return s;
  }

 private:
  static void Free(void* ptr);

  // A freed block of exactly `bytes`, the most recently freed first; null if none.
  char* TakeWhole(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = whole_.find(bytes);
    if (it == whole_.end() || it->second.empty()) return nullptr;
    const Range r = *it->second.back();
    lru_.erase(it->second.back());
    it->second.pop_back();
    cached_ -= static_cast<int64_t>(bytes);
    Lend(r.ptr, bytes);
    ++stats_.hits;
    return r.ptr;
  }

  // A new mapping of `bytes`, its chunk slots (and its tail, when a freed
  // tail of the same size waits) filled with cached pages as far as there are
  // any, within the bound (live + cached <= the peak).
  char* Assemble(size_t bytes) {
    const size_t slots = bytes / kChunk;
    const size_t tail = bytes - slots * kChunk;
    std::vector<char*> chunks;
    char* tail_piece = nullptr;
    std::vector<Range> unmap;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (loose_.size() < slots && !lru_.empty()) BreakOldest();
      while (chunks.size() < slots && !loose_.empty()) {
        chunks.push_back(loose_.back());
        loose_.pop_back();
      }
      if (tail > 0) tail_piece = TakeTail(tail);
      const size_t moved = chunks.size() * kChunk + (tail_piece != nullptr ? tail : 0);
      cached_ -= static_cast<int64_t>(moved);
      const int64_t limit = std::max(peak_, live_ + static_cast<int64_t>(bytes));
      while (cached_ > 0 && live_ + cached_ + static_cast<int64_t>(bytes) > limit) EvictOne(&unmap);
      ++stats_.assembled;
      stats_.moved_bytes += static_cast<int64_t>(moved);
      stats_.fresh_bytes += static_cast<int64_t>(bytes - moved);
    }
    Unmap(unmap);
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      Release();
      base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (base == MAP_FAILED) {
      const int err = errno;
      for (char* c : chunks) ::munmap(c, kChunk);
      if (tail_piece != nullptr) ::munmap(tail_piece, tail);
      std::lock_guard<std::mutex> lock(mu_);
      stats_.returned_bytes += static_cast<int64_t>(chunks.size() * kChunk + (tail_piece != nullptr ? tail : 0));
      TORCH_CHECK_WITH(OutOfMemoryError, false, "host block cache: cannot allocate ", bytes, " bytes (mmap: ",
                       std::strerror(err), "): the machine's memory, this process's limit (ulimit -v) or its number ",
                       "of mappings (vm.max_map_count) is exhausted; SHARDTRAIN_HOST_CACHE=0 turns the cache off");
    }
    char* out = static_cast<char*>(base);
    for (size_t i = 0; i < chunks.size(); ++i) MoveInto(chunks[i], kChunk, out + i * kChunk);
    if (tail_piece != nullptr) MoveInto(tail_piece, tail, out + slots * kChunk);
    std::lock_guard<std::mutex> lock(mu_);
    Lend(out, bytes);
    return out;
  }

  // Moves the pages of [from, from + n) over the fresh, untouched pages at
  // `to` (which go); should that fail, `to` stays fresh and `from` goes.
  static void MoveInto(char* from, size_t n, char* to) {
    if (::mremap(from, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, to) == MAP_FAILED) ::munmap(from, n);
  }

  void Lend(char* ptr, size_t bytes) {
    lent_.emplace(ptr, bytes);
    live_ += static_cast<int64_t>(bytes);
    peak_ = std::max(peak_, live_);
  }

  // The oldest freed block becomes loose chunks and, under a chunk, a tail.
  void BreakOldest() {
    const Range r = lru_.front();
    RemoveFromWhole(lru_.begin());
    lru_.pop_front();
    const size_t n = r.bytes / kChunk;
    for (size_t i = 0; i < n; ++i) loose_.push_back(r.ptr + i * kChunk);
    const size_t tail = r.bytes - n * kChunk;
    if (tail > 0) tails_.emplace(tail, r.ptr + n * kChunk);
  }

  // Cached pages for a tail of `bytes` (under a chunk): the first `bytes` of
  // the smallest piece that holds them, else of a loose chunk; what is left
  // of it stays cached as a piece. Null when nothing cached is that large.
  char* TakeTail(size_t bytes) {
    char* p = nullptr;
    size_t had = 0;
    auto it = tails_.lower_bound(bytes);
    if (it != tails_.end()) {
      had = it->first;
      p = it->second;
      tails_.erase(it);
    } else if (!loose_.empty()) {
      had = kChunk;
      p = loose_.back();
      loose_.pop_back();
    } else {
      return nullptr;
    }
    if (had > bytes) tails_.emplace(had - bytes, p + bytes);
    return p;
  }

  // Gives back one piece, so that no more goes than is needed: the smallest
  // piece under a chunk, else the oldest loose chunk, else the oldest freed
  // block broken into them.
  void EvictOne(std::vector<Range>* unmap) {
    if (loose_.empty() && tails_.empty() && !lru_.empty()) BreakOldest();
    if (!tails_.empty()) {
      GiveBack(Range{tails_.begin()->second, tails_.begin()->first}, unmap);
      tails_.erase(tails_.begin());
      return;
    }
    if (!loose_.empty()) {
      GiveBack(Range{loose_.front(), kChunk}, unmap);
      loose_.pop_front();
    }
  }

  void GiveBack(Range r, std::vector<Range>* unmap) {
    cached_ -= static_cast<int64_t>(r.bytes);
    stats_.returned_bytes += static_cast<int64_t>(r.bytes);
    unmap->push_back(r);
  }

  void RemoveFromWhole(std::list<Range>::iterator pos) {
    auto& same = whole_[pos->bytes];
    same.erase(std::find(same.begin(), same.end(), pos));
  }

  static void Unmap(const std::vector<Range>& ranges) {
    for (const Range& r : ranges) ::munmap(r.ptr, r.bytes);
  }

  // raw_deallocate of a small block, which the inner allocator made.
  void ReturnForeign(void* ptr) {
    c10::DeleterFnPtr d = inner_->raw_deleter();
    if (d != nullptr) {
      d(ptr);
    } else {
      ST_LOG(ERROR) << "host block cache: freeing " << ptr << ", which no allocator here made; it is leaked";
    }
  }

  c10::Allocator* const inner_;
  std::mutex mu_;
  std::unordered_map<void*, size_t> lent_;  // blocks in use: start -> bytes
  std::list<Range> lru_;                    // freed whole blocks, oldest first
  std::unordered_map<size_t, std::vector<std::list<Range>::iterator>> whole_;  // the same, by size
  std::deque<char*> loose_;                 // chunks of broken blocks, oldest first
  std::multimap<size_t, char*> tails_;      // pieces under a chunk (blocks' tails, what splits left), by size
  int64_t live_ = 0;
  int64_t cached_ = 0;
  int64_t peak_ = 0;
  HostCacheStats stats_;
};

// Set once when installed, never freed (storage may outlive main). An
// allocator installed later (a test's counting one) may wrap it.
HostBlockCache* g_cache = nullptr;

void HostBlockCache::Free(void* ptr) { g_cache->Return(ptr); }

}  // namespace

bool InstallHostBlockCache() {
  // Checked outside call_once, so that a bad value stops in every build
  // (AddressSanitizer's included) and no exception crosses call_once (under
  // ThreadSanitizer its pthread_once then never completes: the next call hangs).
  const bool wanted = CacheWanted();
  static std::once_flag once;
  std::call_once(once, [wanted] {
    if (!wanted) return;
#if defined(__SANITIZE_ADDRESS__)
    // Reused blocks would hide a use after free from AddressSanitizer.
    return;
#endif
    auto* cache = new HostBlockCache(c10::GetCPUAllocator());
    c10::SetCPUAllocator(cache, /*priority=*/0);
    if (c10::GetCPUAllocator() != cache) {
      // Installed with a priority above LibTorch's default: the program's own choice stays.
      ST_LOG(INFO) << "the program installed a CPU allocator of its own: freed host blocks are not cached";
      delete cache;
      return;
    }
    g_cache = cache;
  });
  return g_cache != nullptr;
}

void ReleaseHostBlockCache() {
  if (g_cache == nullptr) return;
  g_cache->Release();
  // And the free pages inside glibc's heap: what was freed there before the
  // cache served the large blocks (a model built whole, then sharded) would
  // otherwise stay resident, no longer reused by them.
  internal::TrimMallocHeap();
}

HostCacheStats GetHostCacheStats() { return g_cache != nullptr ? g_cache->Stats() : HostCacheStats{}; }

}  // namespace shardtrain::sharding
