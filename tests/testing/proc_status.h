// This process's memory figures from /proc (Linux), for the memory tests
// (tests/trainer:sharded_memory_test) and the memory benchmark
// (bench/memory:memory_bench).
#ifndef SHARDTRAIN_TESTS_TESTING_PROC_STATUS_H_
#define SHARDTRAIN_TESTS_TESTING_PROC_STATUS_H_

#include <cstdint>

namespace shardtrain::testing {

// The value in kB of the line `key` of /proc/self/status (e.g. "VmRSS": the
// resident set; "VmHWM": its peak), or -1 when there is no such line.
int64_t ProcStatusKb(const char* key);

// Resets VmHWM to the current VmRSS (writes "5" to /proc/self/clear_refs).
// False when the file cannot be written; some kernels (gVisor, some containers)
// accept the write and still leave VmHWM as it was.
bool ResetPeakRss();

}  // namespace shardtrain::testing

#endif  // SHARDTRAIN_TESTS_TESTING_PROC_STATUS_H_
