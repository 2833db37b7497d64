// Internal to //comm:nccl: the state an NcclCommunicator shares with its Work
// handles (the NCCL communicator, its stream, the collectives in flight and
// the fault state), and the bounded waits on it (comm/nccl_watch.cc).
#ifndef SHARDTRAIN_COMM_NCCL_INTERNAL_NCCL_STATE_H_
#define SHARDTRAIN_COMM_NCCL_INTERNAL_NCCL_STATE_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "comm/peer_watch.h"
#include "comm/stall_watch.h"

namespace shardtrain::comm::internal {
using Clock = std::chrono::steady_clock;

// "<what> failed: NCCL error N (name): <last error>", naming peers as a possible cause when `peer_note`.
std::string NcclFailure(const std::string& what, ncclResult_t state, ncclComm_t comm, bool peer_note);
// "<what> timed out after <ms> ms (...); how to change the timeout".
std::string NcclTimeout(const std::string& what, std::chrono::milliseconds t);

// One collective in flight.
struct NcclOp {
  // "AllGather on nccl group 'world' (rank 0/2, cuda:0; collective #5 of this rank)"
  std::string what;
  std::chrono::milliseconds timeout{0};
  Clock::time_point deadline;
  cudaEvent_t done = nullptr;  // recorded on the communicator's stream after the collective
  bool ok = false;             // seen complete while the communicator was healthy
  int64_t seq = 0;             // collective #seq of this rank
  const char* title = "";      // "AllReduce", ... (a string literal)
  // Marks this rank as waiting in the collective for the stall watch, while
  // the watchdog watches it (dropped once seen complete). mu held.
  std::unique_ptr<PeerWatch::Waiting> waiting;

  NcclOp() = default;
  NcclOp(const NcclOp&) = delete;
  NcclOp& operator=(const NcclOp&) = delete;
  ~NcclOp() {
    if (done) (void)cudaEventDestroy(done);
  }
};

// The NCCL communicator, its stream and its fault state. Shared by the
// NcclCommunicator and its Work handles, so a Work outliving its communicator
// stays valid; the NCCL communicator is destroyed with the last of them.
struct NcclState {
  std::string name;
  int rank = 0;
  int size = 1;
  int device = 0;
  std::chrono::milliseconds timeout{0};
  cudaStream_t stream = nullptr;  // LibTorch's pool, non-blocking, high priority; outlives the state
  cudaEvent_t ready = nullptr;    // marks the caller's stream position (issuing thread only)

  std::mutex mu;  // guards everything below and every NCCL call on `comm`
  ncclComm_t comm = nullptr;
  int64_t issued = 0;  // collectives issued (numbers them in messages)
  bool aborted = false;
  bool timed_out = false;
  std::string error;
  std::vector<std::shared_ptr<NcclOp>> pending;  // watched by the watchdog
  // Heartbeats and stalled-peer reports (NcclOptions::stall_*); null when off.
  // Its failure is checked by PollLocked. Set before the first collective.
  std::shared_ptr<StallWatch> watch;
  // Runs ncclCommAbort, which may wait for the GPU: the failing wait throws
  // without waiting for it. Joined by the destructor.
  std::thread aborter;

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;
  ~NcclState();

  // Marks the communicator failed with `message` (later calls throw it at
  // once) and aborts the NCCL communicator (ending its kernels) on a thread
  // of its own. mu held.
  void AbortLocked(const std::string& message, bool timeout);
  // Throws the recorded error. mu held.
  [[noreturn]] void ThrowErrorLocked() const {
    if (timed_out) throw CommTimeoutError(error);
    throw CommError(error);
  }
  // After an NCCL call that returned ncclSuccess or ncclInProgress on this
  // nonblocking communicator: polls until it is enqueued (or initialized),
  // aborting on an error or at `deadline`. mu held.
  void WaitReadyLocked(const std::string& what, std::chrono::milliseconds timeout, Clock::time_point deadline);
  // Checks `op` once without blocking: sets op.ok when complete; aborts the
  // communicator on an asynchronous NCCL error, a CUDA error, a stalled peer
  // (watch's failure) or at `deadline`. mu held; the calling thread's
  // current device is `device`.
  void PollLocked(NcclOp& op, Clock::time_point deadline);
  // Blocks the host until `op` completed (polling its event against
  // `deadline`; a non-zero `timeout` replaces the collective's own in the
  // message). Throws the communicator's error once it failed. mu not held.
  void WaitComplete(NcclOp& op, std::chrono::milliseconds timeout, Clock::time_point deadline);
};

}  // namespace shardtrain::comm::internal

#endif  // SHARDTRAIN_COMM_NCCL_INTERNAL_NCCL_STATE_H_
