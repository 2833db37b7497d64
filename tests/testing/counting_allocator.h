// A counting CPU allocator for memory tests: wraps LibTorch's CPU allocator
// and keeps, per thread, the bytes of CPU storage that thread allocated and
// that are still alive (freed from any thread). Threads-as-ranks tests read
// their own rank's live bytes undisturbed by the other ranks and by Gloo's
// threads.
#ifndef SHARDTRAIN_TESTS_TESTING_COUNTING_ALLOCATOR_H_
#define SHARDTRAIN_TESTS_TESTING_COUNTING_ALLOCATOR_H_

#include <cstdint>

namespace shardtrain::testing {

// Installs the counting allocator as the process's CPU allocator (once;
// later calls do nothing), over the sharding core's host block cache
// (installed first). Storage allocated before stays uncounted.
void InstallCountingCpuAllocator();

// Bytes of CPU storage the calling thread allocated since the install that
// are still alive.
int64_t LiveCpuBytesOfThisThread();

// The most live bytes the calling thread reached (counted when it allocates)
// since the install or the last reset; a reset starts from the current live
// bytes. For "peak during this phase" checks.
void ResetPeakCpuBytesOfThisThread();
int64_t PeakCpuBytesOfThisThread();

}  // namespace shardtrain::testing

#endif  // SHARDTRAIN_TESTS_TESTING_COUNTING_ALLOCATOR_H_
