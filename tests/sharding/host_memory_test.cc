// The host block cache (sharding/host_memory.h) on its own: freed blocks are
// reused whole, freed pages move into blocks of other sizes without being
// faulted in again, live + cached bytes never exceed the peak of live bytes,
// a release gives everything back to the system, tensors keep their contents
// through all of it, and rank-like threads share it safely.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "sharding/host_memory.h"
#include "tests/testing/proc_status.h"

namespace shardtrain::sharding {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Installs the cache once for the whole binary, after checking that a bad
// SHARDTRAIN_HOST_CACHE stops with a message naming the valid values.
bool Installed() {
  static const bool installed = [] {
    ::setenv("SHARDTRAIN_HOST_CACHE", "yes", 1);
    try {
      InstallHostBlockCache();
      ADD_FAILURE() << "SHARDTRAIN_HOST_CACHE=yes was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("SHARDTRAIN_HOST_CACHE='yes' is not valid: 1"), std::string::npos)
          << e.what();
    }
    ::unsetenv("SHARDTRAIN_HOST_CACHE");
    return InstallHostBlockCache();
  }();
  return installed;
}

#define REQUIRE_CACHE()                                                                       \
  do {                                                                                        \
    if (!Installed()) GTEST_SKIP() << "skipped: the host block cache is off (AddressSanitizer)"; \
  } while (0)

at::Tensor Floats(int64_t bytes, float value) { return at::full({bytes / 4}, value, at::kFloat); }

int64_t MinorFaultsOfThisThread() {
  struct rusage r {};
  getrusage(RUSAGE_THREAD, &r);
  return r.ru_minflt;
}

void ExpectWithinPeak() {
  const HostCacheStats s = GetHostCacheStats();
  EXPECT_LE(s.live_bytes + s.cached_bytes, s.peak_bytes)
      << "live " << s.live_bytes << " + cached " << s.cached_bytes << " exceed the peak " << s.peak_bytes;
}

TEST(HostBlockCache, ReusesAFreedBlockOfTheSameSize) {
  REQUIRE_CACHE();
  ReleaseHostBlockCache();
  const HostCacheStats before = GetHostCacheStats();
  { at::Tensor a = Floats(8 * kMiB, 1.0f); }
  const HostCacheStats freed = GetHostCacheStats();
  EXPECT_EQ(freed.cached_bytes, 8 * kMiB);
  at::Tensor b = at::empty({2 * kMiB}, at::kFloat);
  const HostCacheStats after = GetHostCacheStats();
  EXPECT_EQ(after.hits - before.hits, 1);
  EXPECT_EQ(after.fresh_bytes - freed.fresh_bytes, 0);
  EXPECT_EQ(after.cached_bytes, 0);
  EXPECT_EQ(after.live_bytes - before.live_bytes, 8 * kMiB);
  ExpectWithinPeak();
}

TEST(HostBlockCache, SmallBlocksAreNotCached) {
  REQUIRE_CACHE();
  ReleaseHostBlockCache();
  const HostCacheStats before = GetHostCacheStats();
  { at::Tensor a = Floats(kHostBlockCacheMinBytes - 4096, 1.0f); }
  const HostCacheStats after = GetHostCacheStats();
  EXPECT_EQ(after.hits + after.assembled, before.hits + before.assembled);
  EXPECT_EQ(after.cached_bytes, 0);
}

// Pages freed in blocks of one size serve a block of another size, moved
// without a fault, and what the new block holds is its own.
TEST(HostBlockCache, MovesFreedPagesIntoABlockOfAnotherSize) {
  REQUIRE_CACHE();
  ReleaseHostBlockCache();
  at::Tensor keep = Floats(3 * kMiB, 7.0f);  // stays live throughout
  {
    std::vector<at::Tensor> small;
    for (int i = 0; i < 8; ++i) small.push_back(Floats(3 * kMiB, static_cast<float>(i)));
  }
  const HostCacheStats before = GetHostCacheStats();
  EXPECT_EQ(before.cached_bytes, 24 * kMiB);
  const int64_t faults_before = MinorFaultsOfThisThread();
  at::Tensor big = at::empty({12 * kMiB / 4}, at::kFloat);
  at::Tensor big2 = at::empty({12 * kMiB / 4}, at::kFloat);
  big.fill_(3.0f);
  big2.fill_(4.0f);
  const int64_t faults = MinorFaultsOfThisThread() - faults_before;
  const HostCacheStats after = GetHostCacheStats();
  EXPECT_EQ(after.assembled - before.assembled, 2);
  EXPECT_EQ(after.moved_bytes - before.moved_bytes, 24 * kMiB);
  EXPECT_EQ(after.fresh_bytes - before.fresh_bytes, 0);
  EXPECT_EQ(after.cached_bytes, 0);
  // 24 MiB faulted in afresh would be 6144 faults.
  EXPECT_LT(faults, 256) << "the moved pages were faulted in again";
  EXPECT_EQ(big.min().item<float>(), 3.0f);
  EXPECT_EQ(big2.max().item<float>(), 4.0f);
  EXPECT_EQ(keep.min().item<float>(), 7.0f);
  EXPECT_EQ(keep.max().item<float>(), 7.0f);
  ExpectWithinPeak();
}

// Blocks whose sizes are not whole chunks: a block's tail (under 1 MiB) is
// cached too and fills the tail of another block, split to size.
TEST(HostBlockCache, TailsFillTheTailsOfOtherBlocks) {
  REQUIRE_CACHE();
  ReleaseHostBlockCache();
  {
    std::vector<at::Tensor> blocks;
    for (int i = 0; i < 4; ++i) blocks.push_back(Floats(3 * kMiB + 64 * 1024, 1.0f));
  }
  const HostCacheStats before = GetHostCacheStats();
  at::Tensor a = Floats(6 * kMiB + 32 * 1024, 2.0f);
  at::Tensor b = Floats(6 * kMiB + 32 * 1024, 3.0f);
  const HostCacheStats after = GetHostCacheStats();
  EXPECT_EQ(after.fresh_bytes - before.fresh_bytes, 0);
  EXPECT_EQ(after.moved_bytes - before.moved_bytes, 2 * (6 * kMiB + 32 * 1024));
  EXPECT_EQ(after.cached_bytes, 4 * 64 * 1024 - 2 * 32 * 1024);
  EXPECT_EQ(a.min().item<float>(), 2.0f);
  EXPECT_EQ(b.max().item<float>(), 3.0f);
  ExpectWithinPeak();
}

// A step that repeats (allocations of many sizes, freed in another order)
// takes no fresh memory once the first has run, and stays within its peak.
TEST(HostBlockCache, RepeatedStepsTakeNoFreshMemory) {
  REQUIRE_CACHE();
  ReleaseHostBlockCache();
  const std::vector<int64_t> sizes = {2 * kMiB, 5 * kMiB, 12 * kMiB, 3 * kMiB, 16 * kMiB, 2 * kMiB, 7 * kMiB};
  auto step = [&] {
    std::vector<at::Tensor> forward;
    for (int64_t s : sizes) forward.push_back(Floats(s, 1.0f));
    std::vector<at::Tensor> backward;
    for (size_t i = forward.size(); i-- > 0;) {
      backward.push_back(Floats(sizes[(i + 3) % sizes.size()] * 2, 2.0f));
      forward[i] = at::Tensor();
      if (backward.size() > 2) backward.erase(backward.begin());
    }
  };
  step();
  step();
  const HostCacheStats before = GetHostCacheStats();
  const int64_t faults_before = MinorFaultsOfThisThread();
  for (int i = 0; i < 3; ++i) step();
  const HostCacheStats after = GetHostCacheStats();
  const int64_t faults = MinorFaultsOfThisThread() - faults_before;
  EXPECT_EQ(after.fresh_bytes - before.fresh_bytes, 0);
  EXPECT_EQ(after.returned_bytes - before.returned_bytes, 0);
  EXPECT_EQ(after.peak_bytes, before.peak_bytes);
  // Each step fills 2 x 47 MiB of blocks (24k pages if they were faulted in).
  EXPECT_LT(faults, 3 * 256) << "steps after the first faulted their pages in again";
  ExpectWithinPeak();
}

// Random sizes and lifetimes: the bound holds after every operation, and
// every live tensor keeps what was written into it.
TEST(HostBlockCache, RandomTrafficStaysWithinThePeakAndKeepsContents) {
  REQUIRE_CACHE();
  ReleaseHostBlockCache();
  std::mt19937 rng(5);
  std::vector<std::pair<at::Tensor, float>> live;
  for (int op = 0; op < 400; ++op) {
    if (!live.empty() && (rng() % 3 == 0 || live.size() > 24)) {
      const size_t k = rng() % live.size();
      const auto& [t, v] = live[k];
      ASSERT_EQ(t.min().item<float>(), v) << "op " << op;
      ASSERT_EQ(t.max().item<float>(), v) << "op " << op;
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const int64_t bytes = kMiB / 2 + static_cast<int64_t>(rng() % (20 * kMiB)) / 4 * 4;
      const float v = static_cast<float>(op);
      live.emplace_back(Floats(bytes, v), v);
    }
    const HostCacheStats s = GetHostCacheStats();
    ASSERT_LE(s.live_bytes + s.cached_bytes, s.peak_bytes) << "op " << op;
  }
  for (const auto& [t, v] : live) {
    EXPECT_EQ(t.min().item<float>(), v);
    EXPECT_EQ(t.max().item<float>(), v);
  }
}

// A release gives every cached page back: the resident set drops by them.
TEST(HostBlockCache, ReleaseGivesCachedPagesBack) {
  REQUIRE_CACHE();
  ReleaseHostBlockCache();
  { at::Tensor a = Floats(64 * kMiB, 1.0f); }
  const HostCacheStats cached = GetHostCacheStats();
  EXPECT_EQ(cached.cached_bytes, 64 * kMiB);
  const int64_t rss_cached = testing::ProcStatusKb("VmRSS");
  ReleaseHostBlockCache();
  const int64_t rss_released = testing::ProcStatusKb("VmRSS");
  const HostCacheStats after = GetHostCacheStats();
  EXPECT_EQ(after.cached_bytes, 0);
  EXPECT_EQ(after.peak_bytes, after.live_bytes);
  EXPECT_GE(rss_cached - rss_released, 60 * 1024) << "VmRSS " << rss_cached << " kB -> " << rss_released << " kB";
}

// A release also gives back the free pages inside glibc's heap (blocks under
// 1 MiB, and what was freed there before the cache was installed).
TEST(HostBlockCache, ReleaseTrimsTheFreePagesOfTheHeap) {
  REQUIRE_CACHE();
#if defined(__GLIBC__) && !defined(__SANITIZE_THREAD__)  // as host_block_cache.cc: ThreadSanitizer has its own malloc
  KeepFreedHostMemoryReturnable();  // 512 KiB blocks from the heap, as in a sharded run
  std::vector<at::Tensor> small;
  for (int i = 0; i < 160; ++i) small.push_back(Floats(512 * 1024, 1.0f));
  at::Tensor last = small.back();  // keeps the heap's top in use: free() cannot trim it
  small.clear();
  const int64_t rss_holes = testing::ProcStatusKb("VmRSS");
  ReleaseHostBlockCache();
  const int64_t rss_trimmed = testing::ProcStatusKb("VmRSS");
  EXPECT_GE(rss_holes - rss_trimmed, 64 * 1024) << "VmRSS " << rss_holes << " kB -> " << rss_trimmed << " kB";
#else
  GTEST_SKIP() << "skipped: not glibc's malloc (another libc, or ThreadSanitizer's allocator)";
#endif
}

// A bad SHARDTRAIN_MMAP_THRESHOLD stops with the valid range, in every build,
// and leaves the next call free to set the threshold (the check runs outside
// the once-per-process part, which an exception would leave unfinished).
TEST(HostMemory, ABadMmapThresholdStopsWithTheValidRange) {
  ::setenv("SHARDTRAIN_MMAP_THRESHOLD", "4M", 1);
  try {
    KeepFreedHostMemoryReturnable();
    ADD_FAILURE() << "SHARDTRAIN_MMAP_THRESHOLD=4M was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("SHARDTRAIN_MMAP_THRESHOLD='4M' is not valid: give a number of bytes from 0"),
              std::string::npos)
        << e.what();
  }
  ::unsetenv("SHARDTRAIN_MMAP_THRESHOLD");
  EXPECT_THROW(KeepFreedHostMemoryReturnable(0), std::exception);
  KeepFreedHostMemoryReturnable();  // returns (under ThreadSanitizer too)
}

// Four threads, each allocating and freeing blocks of its own sizes and
// checking their contents, share one cache.
TEST(HostBlockCache, ThreadsShareTheCache) {
  REQUIRE_CACHE();
  ReleaseHostBlockCache();
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([r, &bad] {
      for (int i = 0; i < 60; ++i) {
        const float v = static_cast<float>(r * 1000 + i);
        at::Tensor a = Floats((2 + (i + r) % 5) * kMiB, v);
        at::Tensor b = Floats((1 + (i * 3 + r) % 7) * kMiB + 4096 * r, -v);
        if (a.min().item<float>() != v || a.max().item<float>() != v) ++bad[r];
        if (b.min().item<float>() != -v || b.max().item<float>() != -v) ++bad[r];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(bad[r], 0) << "thread " << r;
  ExpectWithinPeak();
}

}  // namespace
}  // namespace shardtrain::sharding
