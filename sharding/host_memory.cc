#include "sharding/host_memory.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "base/errors.h"
#include "base/logging.h"

// Under AddressSanitizer or ThreadSanitizer malloc is the sanitizer's, not
// glibc's: nothing to set.
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define SHARDTRAIN_GLIBC_MALLOC 1
#include <malloc.h>
#endif

namespace shardtrain::sharding {
namespace {

#ifdef SHARDTRAIN_GLIBC_MALLOC
// SHARDTRAIN_MMAP_THRESHOLD: unset (-1), 0 (leave malloc alone) or bytes.
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

#endif  // SHARDTRAIN_GLIBC_MALLOC

bool Apply(int64_t threshold_bytes) {
#ifdef SHARDTRAIN_GLIBC_MALLOC
  ST_CHECK_ARG(threshold_bytes > 0, "KeepFreedHostMemoryReturnable: threshold_bytes must be > 0, got ",
               threshold_bytes);
  const int64_t env = ThresholdFromEnvironment();
  if (env == 0 || UserChoseThreshold()) return false;
  const int64_t bytes = env > 0 ? env : threshold_bytes;
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) != 1) {
    ST_LOG(WARNING) << "mallopt(M_MMAP_THRESHOLD, " << bytes
                    << ") failed: freed host memory may stay resident (set SHARDTRAIN_MMAP_THRESHOLD=0 to silence)";
    return false;
  }
  return true;
#else
  (void)threshold_bytes;
  return false;
#endif
}

}  // namespace

bool KeepFreedHostMemoryReturnable(int64_t threshold_bytes) {
  static std::once_flag once;
  static bool applied = false;
  std::call_once(once, [&] { applied = Apply(threshold_bytes); });
  return applied;
}

}  // namespace shardtrain::sharding
