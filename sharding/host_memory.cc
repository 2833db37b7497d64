#include "sharding/host_memory.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "base/errors.h"
#include "base/logging.h"
#include "sharding/internal/malloc_heap.h"

// Under AddressSanitizer or ThreadSanitizer malloc is the sanitizer's, not
// glibc's: nothing to set.
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define SHARDTRAIN_GLIBC_MALLOC 1
#include <malloc.h>
#endif

namespace shardtrain::sharding {
namespace {

// SHARDTRAIN_MMAP_THRESHOLD: unset (-1), 0 (leave malloc alone) or bytes.
// Checked in every build, glibc's malloc or not.
int64_t ThresholdFromEnvironment() {
  const char* v = std::getenv("SHARDTRAIN_MMAP_THRESHOLD");
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  ST_CHECK_ARG(end != nullptr && *end == '\0' && n >= 0 && n <= (int64_t{1} << 30),
               "SHARDTRAIN_MMAP_THRESHOLD='", v,
               "' is not valid: give a number of bytes from 0 (leave glibc's malloc as it is) to 1073741824");
  return n;
}

bool UserChoseThreshold() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr) return true;
  const char* t = std::getenv("GLIBC_TUNABLES");
  return t != nullptr && std::strstr(t, "glibc.malloc.mmap_threshold") != nullptr;
}

// The threshold to set, 0 for none. It checks its input, so it runs outside
// call_once: an exception thrown through call_once leaves ThreadSanitizer's
// pthread_once unfinished, and the next call hangs.
int64_t ChosenThreshold(int64_t threshold_bytes) {
  ST_CHECK_ARG(threshold_bytes > 0, "KeepFreedHostMemoryReturnable: threshold_bytes must be > 0, got ",
               threshold_bytes);
  const int64_t env = ThresholdFromEnvironment();
  if (env == 0 || UserChoseThreshold()) return 0;
  return env > 0 ? env : threshold_bytes;
}

bool Apply(int64_t bytes) {
#ifdef SHARDTRAIN_GLIBC_MALLOC
  if (bytes == 0) return false;
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) != 1) {
    ST_LOG(WARNING) << "mallopt(M_MMAP_THRESHOLD, " << bytes
                    << ") failed: freed host memory may stay resident (set SHARDTRAIN_MMAP_THRESHOLD=0 to silence)";
    return false;
  }
  return true;
#else
  (void)bytes;
  return false;
#endif
}

}  // namespace

bool KeepFreedHostMemoryReturnable(int64_t threshold_bytes) {
  const int64_t bytes = ChosenThreshold(threshold_bytes);
  static std::once_flag once;
  static bool applied = false;
  std::call_once(once, [bytes] { applied = Apply(bytes); });
  return applied;
}

namespace internal {

void TrimMallocHeap() {
#ifdef SHARDTRAIN_GLIBC_MALLOC
  malloc_trim(0);
#endif
}

}  // namespace internal

}  // namespace shardtrain::sharding
