// NcclState (comm/nccl/internal/nccl_state.h): the fault state of an NCCL communicator and
// its bounded waits. Every wait polls (a CUDA event, NCCL's asynchronous
// state) against a deadline with WaitWithDeadline (comm/deadline_wait.h);
// on expiry the communicator is marked failed, ncclCommAbort runs on a thread
// of its own, and CommTimeoutError is thrown now and by every later call.
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdio>

#include "comm/deadline_wait.h"
#include "comm/nccl/internal/nccl_state.h"

namespace shardtrain::comm::internal {

using ::shardtrain::internal::StrCat;

std::string NcclFailure(const std::string& what, ncclResult_t state, ncclComm_t comm, bool peer_note) {
  const char* last = ncclGetLastError(comm);  // comm may be null (init failed): the last global error
  return StrCat(what, " failed: NCCL error ", static_cast<int>(state), " (", ncclGetErrorString(state), ")",
                (last && *last) ? std::string(": ") + last : std::string(),
                peer_note ? " (a peer rank may have died or failed)" : "");
}

std::string NcclTimeout(const std::string& what, std::chrono::milliseconds t) {
  return StrCat(what, " timed out after ", t.count(),
                " ms (a peer rank may have died, hung, or not reached this collective, or GPU work queued before it "
                "has not finished); if it legitimately takes longer, raise NcclOptions::timeout (the Trainer's: "
                "TrainerOptions::timeout, --timeout_s)");
}

NcclState::~NcclState() {
  if (aborter.joinable()) aborter.join();
  if (comm != nullptr && !aborted) {
    // Flush and free the communicator; abort if it does not quiesce in time.
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const ncclResult_t fr = ncclCommFinalize(comm);
    bool clean = fr == ncclSuccess || fr == ncclInProgress;
    const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(60));
    if (clean) {
      bool failed = false;  // an NCCL error while finalizing
      clean = WaitWithDeadline(
          [&] {
            ncclResult_t state = ncclInProgress;
            failed = ncclCommGetAsyncError(comm, &state) != ncclSuccess ||
                     (state != ncclSuccess && state != ncclInProgress);
            return failed || state == ncclSuccess;
          },
          deadline, [] {}, std::chrono::microseconds(100)) && !failed;
    }
    if (clean) {
      (void)ncclCommDestroy(comm);
    } else {
      std::fprintf(stderr, "[shardtrain] nccl group '%s' (rank %d/%d) did not finalize cleanly; aborting it\n",
                   name.c_str(), rank, size);
      (void)ncclCommAbort(comm);
    }
    comm = nullptr;
  }
  pending.clear();
  if (ready) (void)cudaEventDestroy(ready);
  // `stream` belongs to LibTorch's stream pool: never destroyed.
}

void NcclState::AbortLocked(const std::string& message, bool timeout) {
  if (aborted) return;
  aborted = true;
  timed_out = timeout;
  error = message + "; the NCCL communicator was aborted (every later call on it fails)";
  std::fprintf(stderr, "[shardtrain] %s\n", error.c_str());
  if (comm != nullptr) {
    // ncclCommAbort ends the communicator's kernels but may wait for the GPU
    // (work queued before the collective): the caller does not wait for it.
    aborter = std::thread([c = comm, d = device] {
      (void)cudaSetDevice(d);
      (void)ncclCommAbort(c);
    });
    comm = nullptr;
  }
}

void NcclState::WaitReadyLocked(const std::string& what, std::chrono::milliseconds timeout,
                                Clock::time_point deadline) {
  WaitWithDeadline(
      [&] {
        if (comm == nullptr) ThrowErrorLocked();
        ncclResult_t state = ncclInProgress;
        const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
        if (r != ncclSuccess) state = r;
        if (state == ncclSuccess) return true;
        if (state != ncclInProgress) {
          AbortLocked(NcclFailure(what, state, comm, true), false);
          ThrowErrorLocked();
        }
        return false;
      },
      deadline,
      [&] {
        AbortLocked(NcclTimeout(what, timeout), true);
        ThrowErrorLocked();
      });
}

void NcclState::PollLocked(NcclOp& op, Clock::time_point deadline) {
  if (op.ok || aborted) return;
  const cudaError_t q = cudaEventQuery(op.done);
  if (q == cudaSuccess) {
    op.ok = true;
    op.waiting.reset();
    return;
  }
  if (q != cudaErrorNotReady) {
    (void)cudaGetLastError();
    AbortLocked(StrCat(op.what, " failed: CUDA error ", static_cast<int>(q), " (", cudaGetErrorName(q), ": ",
                       cudaGetErrorString(q), ")"),
                false);
    return;
  }
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = comm ? ncclCommGetAsyncError(comm, &state) : ncclInvalidUsage;
  if (r != ncclSuccess) state = r;
  if (state != ncclSuccess && state != ncclInProgress) {
    AbortLocked(NcclFailure(op.what, state, comm, true), false);
    return;
  }
  if (watch) {
    if (std::string stalled = watch->Failure(); !stalled.empty()) {
      AbortLocked(StrCat(op.what, " failed: ", stalled), true);
      return;
    }
  }
  if (Clock::now() > deadline) {
    AbortLocked(NcclTimeout(op.what, op.timeout), true);
  }
}

void NcclState::WaitComplete(NcclOp& op, std::chrono::milliseconds timeout, Clock::time_point deadline) {
  std::unique_ptr<PeerWatch::Waiting> blocked;  // for the stall watch, when the watchdog does not watch op
  {
    std::lock_guard<std::mutex> lock(mu);
    if (watch && !op.waiting && !op.ok) blocked = watch->BlockedIn(op.seq, op.title);
  }
  WaitWithDeadline(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        PollLocked(op, Clock::time_point::max());  // errors only: the deadline is this wait's
        if (op.ok) return true;
        if (aborted) ThrowErrorLocked();
        return false;
      },
      deadline,
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        if (op.ok) return;
        // An explicit Wait timeout is reported like the collective's own.
        if (!aborted) AbortLocked(NcclTimeout(op.what, timeout.count() > 0 ? timeout : op.timeout), true);
        ThrowErrorLocked();
      },
      std::chrono::microseconds(500));
}

}  // namespace shardtrain::comm::internal
