// NcclCommunicator: collectives on CUDA tensors over NCCL, called directly
// (not through c10d's ProcessGroupNCCL). Built only with --config=cuda.
//
// One NCCL communicator per group, bound to one CUDA device, with a
// high-priority non-blocking CUDA stream taken from LibTorch's stream pool
// (which outlives every tensor the allocator may still record on it). A collective is ordered after the
// work already queued on the caller's current stream by an event, runs on the
// communicator's stream, and records a completion event; Work::Wait makes the
// caller's current stream wait on that event. Tensors are recordStream'ed on
// the communicator's stream, so the caching allocator does not hand their
// memory out again before the collective finished even if the caller drops
// them.
//
// Dtypes: float32, float64, float16, bfloat16, int8, uint8, int32, int64.
// Reductions: SUM, AVG (ncclAvg), MAX, MIN; pre_divide is a pre-multiplied sum
// (ncclRedOpCreatePreMulSum, the input is not modified), post_divide a division
// on the communicator's stream after the collective (floating dtypes only).
//
// Timeouts and faults: NcclOptions::timeout (default 30 min, as Gloo's and
// c10d's; the Trainer passes TrainerOptions::timeout) bounds everything. The
// communicator is nonblocking (ncclConfig_t::blocking = 0), so initialization
// and every enqueue are polled against it (comm/deadline_wait.h). A watchdog
// thread checks the collectives in flight (cudaEventQuery, never a blocking
// synchronize); one not complete within the timeout (or an asynchronous NCCL
// error such as a dead peer's closed connection) marks the communicator
// failed, aborts the NCCL communicator (ncclCommAbort, which also ends its
// kernels on the GPU, on a thread of its own so that the wait does not wait
// for it) and the error is thrown, as CommTimeoutError or CommError naming the
// operation, its number (collective #N of this rank), the group, the timeout
// and how to change it, from Wait() and at once from every later call. With NcclOptions::blocking_wait the host
// thread also blocks in Wait() until the collective completed (a nonzero Wait
// timeout bounds that wait, expiry aborting the group as above; the watchdog
// still applies the group's timeout). Barrier()'s Work always blocks the host.
// Stalled peers are named from heartbeats as in the Gloo backend
// (NcclOptions::stall_warning, stall_timeout).
//
// Accounting (CommStats), as the Gloo backend: all-gather and reduce-scatter
// (W-1)/W of the full buffer, all-reduce 2(W-1)/W (ring), broadcast (W-1)
// copies charged to the root.
//
// Thread-safety: as Communicator (one issuing thread at a time); Work handles
// may be waited on from any thread; the watchdog runs concurrently.
#ifndef SHARDTRAIN_COMM_NCCL_COMMUNICATOR_H_
#define SHARDTRAIN_COMM_NCCL_COMMUNICATOR_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace shardtrain::comm {

// NCCL's options; timeout, stall_warning and stall_timeout come from CommLimits
// (comm/communicator.h).
struct NcclOptions : CommLimits {
  std::string name = "world";
  // CUDA device of this rank; -1: the calling thread's current CUDA device.
  int device = -1;
  // false (default): Wait() orders the caller's current stream after the
  // collective and returns without blocking the host (errors recorded so far
  // are thrown; the watchdog enforces the timeout). true: Wait() also blocks
  // the host until the collective completed, polling for NCCL errors, and
  // enforces the timeout itself.
  bool blocking_wait = false;
  // How often the watchdog checks collectives in flight; 0 disables it (only
  // Wait() then enforces timeouts).
  std::chrono::milliseconds watchdog_interval = std::chrono::milliseconds(100);
  // Stalled peers (CommLimits' stall_warning, stall_timeout; comm/stall_watch.h):
  // with W > 1, heartbeat_period > 0 and stall_warning or stall_timeout > 0,
  // every rank publishes a heartbeat (collectives issued) to the store every
  // heartbeat_period; while a collective of this rank is in flight (issued,
  // not yet seen complete), a peer that makes no progress for stall_warning
  // is named in a warning (once per stall), and after stall_timeout the
  // watchdog (or a host-blocking Wait) aborts the communicator and throws
  // CommTimeoutError naming that peer. The time counts from the enqueue,
  // including GPU work queued before the collective on this rank.
  std::chrono::milliseconds heartbeat_period = std::chrono::seconds(1);
};

namespace internal {
struct NcclState;  // the NCCL communicator, stream and fault state (nccl_communicator.cc)
}

class NcclCommunicator : public Communicator {
 public:
  // Creates the group's NCCL communicator: rank 0 makes an ncclUniqueId and
  // publishes it in `store` under "<name>/nccl_unique_id"; every rank then
  // joins. Throws CommTimeoutError when the group did not form within the
  // timeout, CommError on NCCL/CUDA errors, InvalidArgumentError on bad
  // arguments. A store serves one communicator per name (NewGroup uses a
  // PrefixStore per sub-group).
  static std::shared_ptr<NcclCommunicator> Create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                  NcclOptions options = {});
  ~NcclCommunicator() override;

  std::string backend() const override { return "nccl"; }
  int device() const { return device_; }
  WorkPtr AllGather(const at::Tensor& input, const at::Tensor& output) override;
  WorkPtr ReduceScatter(const at::Tensor& input, const at::Tensor& output, const ReduceOptions& options) override;
  WorkPtr AllReduce(const at::Tensor& tensor, const ReduceOptions& options) override;
  WorkPtr Broadcast(const at::Tensor& tensor, int root) override;
  // A 1-element all-reduce; its Work blocks the host until it completed.
  WorkPtr Barrier() override;
  CommunicatorPtr NewGroup(const std::vector<int>& ranks, const std::string& name) override;

 private:
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, NcclOptions options);
  void CheckTensor(const char* op, const at::Tensor& t) const;
  std::string Describe(const char* op) const;
  // Orders the communicator's stream after the current stream, runs `issue`
  // (the NCCL call) and then `after` (local work on the communicator's stream),
  // recordStream's `touched`, records the completion event.
  WorkPtr Launch(const char* op, const std::vector<at::Tensor>& touched,
                 const std::function<void(internal::NcclState&, const std::string& what)>& issue,
                 const std::function<void()>& after, bool host_blocking);
  void WatchdogLoop();

  c10::intrusive_ptr<c10d::Store> store_;
  NcclOptions options_;
  int device_ = -1;
  std::shared_ptr<internal::NcclState> state_;
  at::Tensor barrier_buffer_;

  std::mutex watchdog_mu_;
  std::condition_variable watchdog_cv_;
  bool stop_watchdog_ = false;
  std::thread watchdog_;
};

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_NCCL_COMMUNICATOR_H_
