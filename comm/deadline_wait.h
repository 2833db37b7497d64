// WaitWithDeadline: the polling loop behind a bounded wait on something that
// can only be asked "done yet?" without blocking (a CUDA event, an NCCL
// communicator's asynchronous state). Used by NcclCommunicator's Work::Wait
// and enqueue polling; plain C++ (no CUDA or torch header), so that the
// deadline logic is tested on the CPU (tests/comm/peer_watch_test.cc).
#ifndef SHARDTRAIN_COMM_DEADLINE_WAIT_H_
#define SHARDTRAIN_COMM_DEADLINE_WAIT_H_

#include <chrono>
#include <functional>

namespace shardtrain::comm {

// Calls `poll` until it returns true, sleeping between calls (1 us, doubling
// up to `max_sleep`). Once `deadline` has passed and one more `poll` still
// said false, calls `on_timeout` once (which is expected to throw, e.g. after
// aborting what was waited on) and returns false; true when `poll` said done.
// An exception from `poll` or `on_timeout` propagates.
bool WaitWithDeadline(const std::function<bool()>& poll, std::chrono::steady_clock::time_point deadline,
                      const std::function<void()>& on_timeout,
                      std::chrono::microseconds max_sleep = std::chrono::microseconds(1000));

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_DEADLINE_WAIT_H_
