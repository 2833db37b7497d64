#include "comm/nccl_communicator.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include "base/errors.h"
#include "comm/heartbeat_store.h"
#include "comm/nccl/internal/nccl_check.h"
#include "comm/nccl/internal/nccl_state.h"
#include "comm/wait_time.h"

namespace shardtrain::comm {

using ::shardtrain::internal::StrCat;

namespace {
using internal::Clock;
using internal::NcclOp;
using internal::NcclState;

std::optional<ncclDataType_t> NcclType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: return std::nullopt;
  }
}

// How a ReduceOptions maps onto NCCL: a built-in op, or a pre-multiplied sum;
// then an optional division on the communicator's stream.
struct Reduction {
  ncclRedOp_t op = ncclSum;
  std::optional<double> premul;  // ncclRedOpCreatePreMulSum with this factor
  double post_divisor = 1.0;
};

Reduction MakeReduction(const char* opname, const std::string& group, int world, const ReduceOptions& o,
                        at::ScalarType dtype) {
  ST_CHECK_ARG(std::isfinite(o.pre_divide) && std::isfinite(o.post_divide) && o.pre_divide > 0 && o.post_divide > 0,
               opname, " on group '", group, "': divide factors must be finite and > 0, got pre_divide=",
               o.pre_divide, ", post_divide=", o.post_divide);
  const bool scaled = o.pre_divide != 1.0 || o.post_divide != 1.0;
  Reduction r;
  if (o.op == ReduceOp::kMax || o.op == ReduceOp::kMin) {
    ST_CHECK_ARG(!scaled, opname, " on group '", group, "': pre_divide/post_divide apply to SUM and AVG only, not ",
                 ReduceOpName(o.op));
    r.op = o.op == ReduceOp::kMax ? ncclMax : ncclMin;
    return r;
  }
  ST_CHECK_ARG(!scaled || c10::isFloatingType(dtype), opname, " on group '", group,
               "': pre_divide/post_divide need a floating dtype, got ", dtype);
  const bool avg = o.op == ReduceOp::kAvg;
  if (o.pre_divide != 1.0) {
    r.premul = 1.0 / o.pre_divide;
    r.post_divisor = o.post_divide * (avg ? world : 1);
  } else {
    r.op = avg ? ncclAvg : ncclSum;
    r.post_divisor = o.post_divide;
  }
  return r;
}

// Issues `call(op)` with the reduction's NCCL op, creating (and destroying)
// the pre-multiplied sum around it. mu held.
template <typename Call>
void IssueReduction(NcclState& s, const std::string& what, std::chrono::milliseconds timeout,
                    Clock::time_point deadline, const Reduction& red, ncclDataType_t dtype, Call call) {
  if (!red.premul) {
    ST_NCCL_CHECK(call(red.op), what);
    s.WaitReadyLocked(what, timeout, deadline);
    return;
  }
  alignas(8) unsigned char scalar[8] = {};
  const double f = *red.premul;
  switch (dtype) {
    case ncclFloat32: { const float v = static_cast<float>(f); std::memcpy(scalar, &v, sizeof v); break; }
    case ncclFloat64: std::memcpy(scalar, &f, sizeof f); break;
    case ncclFloat16: { const at::Half v(static_cast<float>(f)); std::memcpy(scalar, &v, sizeof v); break; }
    case ncclBfloat16: { const at::BFloat16 v(static_cast<float>(f)); std::memcpy(scalar, &v, sizeof v); break; }
    default: ST_THROW(InvalidArgumentError, what, ": pre_divide needs a floating dtype");
  }
  ncclRedOp_t op;
  ST_NCCL_CHECK(ncclRedOpCreatePreMulSum(&op, scalar, dtype, ncclScalarHostImmediate, s.comm), what);
  s.WaitReadyLocked(what, timeout, deadline);
  try {
    ST_NCCL_CHECK(call(op), what);
    s.WaitReadyLocked(what, timeout, deadline);
  } catch (...) {
    if (s.comm) (void)ncclRedOpDestroy(op, s.comm);
    throw;
  }
  ST_NCCL_CHECK(ncclRedOpDestroy(op, s.comm), what);
}

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> state, std::shared_ptr<NcclOp> op, bool host_blocking)
      : state_(std::move(state)), op_(std::move(op)), host_blocking_(host_blocking) {}

  void Wait(std::chrono::milliseconds timeout) override {
    WaitTimer blocked;  // for profilers (comm/wait_time.h)
    NcclState& s = *state_;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(s.device));
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.PollLocked(*op_, op_->deadline);
      if (s.aborted && !op_->ok) s.ThrowErrorLocked();
      // The caller's stream continues after the collective (GPU side).
      ST_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(s.device).stream(), op_->done, 0),
                    op_->what + ": ordering the current stream after it");
    }
    if (!host_blocking_) return;
    s.WaitComplete(*op_, timeout, timeout.count() > 0 ? Clock::now() + timeout : op_->deadline);
  }

  bool IsCompleted() override {
    NcclState& s = *state_;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(s.device));
    std::lock_guard<std::mutex> lock(s.mu);
    s.PollLocked(*op_, op_->deadline);
    return op_->ok || s.aborted;
  }

 private:
  std::shared_ptr<NcclState> state_;
  std::shared_ptr<NcclOp> op_;
  bool host_blocking_;
};

}  // namespace

NcclCommunicator::NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, NcclOptions options)
    : Communicator(rank, size, options.name, options.timeout), store_(std::move(store)), options_(std::move(options)) {
  ST_CHECK_ARG(options_.watchdog_interval.count() >= 0, "NcclOptions.watchdog_interval must be >= 0, got ",
               options_.watchdog_interval.count(), " ms");
  ST_CHECK_ARG(options_.heartbeat_period.count() >= 0, "NcclOptions.heartbeat_period must be >= 0 ms (0: off), got ",
               options_.heartbeat_period.count(), " ms");
  CheckStallOptions(options_.stall_warning, options_.stall_timeout, "NcclOptions");
  const int count = c10::cuda::device_count();
  ST_CHECK_ARG(count > 0, "nccl group '", name_, "': no CUDA device is visible (use the gloo backend on CPU)");
  device_ = options_.device >= 0 ? options_.device : static_cast<int>(c10::cuda::current_device());
  ST_CHECK_ARG(device_ < count, "nccl group '", name_, "': CUDA device ", device_, " is not visible; valid: 0..",
               count - 1);
  options_.device = device_;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const std::string what = StrCat("creating nccl group '", name_, "' (rank ", rank, "/", size, ", cuda:", device_, ")");

  state_ = std::make_shared<NcclState>();
  NcclState& s = *state_;
  s.name = name_;
  s.rank = rank;
  s.size = size;
  s.device = device_;
  s.timeout = timeout_;
  // A high-priority stream of LibTorch's pool (as ProcessGroupNCCL takes), not
  // one of our own: the caching allocator records events on every stream a
  // block was recordStream'ed on when the block is freed, and tensors that
  // took part in a collective (a model's parameters) may be freed after this
  // communicator is gone. Pool streams live as long as the process.
  s.stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, static_cast<c10::DeviceIndex>(device_)).stream();
  ST_CUDA_CHECK(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming), what);

  // Rendezvous: rank 0's ncclUniqueId through the store.
  const std::string key = name_ + "/nccl_unique_id";
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (rank == 0) {
    ST_NCCL_CHECK(ncclGetUniqueId(&id), what);
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store_->set(key, std::vector<uint8_t>(bytes, bytes + sizeof id));
  } else {
    try {
      store_->wait({key}, timeout_);
    } catch (const std::exception& e) {
      ST_THROW(CommTimeoutError, what, " timed out after ", timeout_.count(), " ms waiting for rank 0's ncclUniqueId (",
               key, ") in the store (is rank 0 running?): ", std::string(e.what()).substr(0, 400));
    }
    const std::vector<uint8_t> value = store_->get(key);
    ST_CHECK_ARG(value.size() == sizeof id, what, ": the store holds ", value.size(), " bytes under '", key,
                 "', not an ncclUniqueId (", sizeof id, " bytes)");
    std::memcpy(&id, value.data(), sizeof id);
  }

  // Nonblocking init, polled against the timeout (ncclCommAbort on expiry).
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = s.name.c_str();  // lives as long as the NCCL communicator
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    s.comm = comm;
    if (r != ncclSuccess && r != ncclInProgress) {
      s.AbortLocked(internal::NcclFailure(what, r, comm, false), false);
      s.ThrowErrorLocked();
    }
    s.WaitReadyLocked(what, timeout_, Clock::now() + timeout_);
  }
  const bool stall_watched = options_.stall_warning.count() > 0 || options_.stall_timeout.count() > 0;
  if (size > 1 && options_.heartbeat_period.count() > 0 && stall_watched) {
    s.watch = std::make_shared<StallWatch>(
        MakeHeartbeatStore(store_), PeerWatchOptions{name_, rank, size, options_.heartbeat_period,
                                                     options_.stall_warning, options_.stall_timeout, "NcclOptions"});
  }

  if (options_.watchdog_interval.count() > 0) watchdog_ = std::thread([this] { WatchdogLoop(); });
}

NcclCommunicator::~NcclCommunicator() {
  if (watchdog_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(watchdog_mu_);
      stop_watchdog_ = true;
    }
    watchdog_cv_.notify_all();
    watchdog_.join();
  }
  // Peers see a "closed" heartbeat (not a stall), even while Work handles keep the state alive.
  if (state_ && state_->watch) state_->watch->Stop();
}

std::shared_ptr<NcclCommunicator> NcclCommunicator::Create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                           NcclOptions options) {
  ST_CHECK_ARG(store, "NcclCommunicator::Create needs a rendezvous store");
  return std::shared_ptr<NcclCommunicator>(new NcclCommunicator(std::move(store), rank, size, std::move(options)));
}

void NcclCommunicator::WatchdogLoop() {
  // Runtime calls on this thread must not create a context on device 0.
  (void)cudaSetDevice(device_);
  while (true) {
    {
      std::unique_lock<std::mutex> lock(watchdog_mu_);
      if (watchdog_cv_.wait_for(lock, options_.watchdog_interval, [this] { return stop_watchdog_; })) return;
    }
    NcclState& s = *state_;
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto& op : s.pending) {
      s.PollLocked(*op, op->deadline);
      if (s.aborted) break;
    }
    if (s.aborted) {
      s.pending.clear();
    } else {
      s.pending.erase(std::remove_if(s.pending.begin(), s.pending.end(), [](const auto& op) { return op->ok; }),
                      s.pending.end());
    }
  }
}

std::string NcclCommunicator::Describe(const char* op) const {
  return StrCat(op, " on nccl group '", name_, "' (rank ", rank_, "/", size_, ", cuda:", device_, ")");
}

void NcclCommunicator::CheckTensor(const char* op, const at::Tensor& t) const {
  ST_CHECK_ARG(t.defined(), op, " on group '", name_, "': tensor must be defined");
  ST_CHECK_ARG(t.is_cuda(), op, " on nccl group '", name_, "': tensors must be CUDA tensors, got ", t.device(),
               " (use the gloo backend for CPU tensors)");
  ST_CHECK_ARG(t.get_device() == device_, op, " on nccl group '", name_, "': tensors must be on cuda:", device_,
               " (this communicator's device), got ", t.device());
  ST_CHECK_ARG(NcclType(t.scalar_type()).has_value(), op, " on nccl group '", name_, "': unsupported dtype ",
               t.scalar_type(), "; valid: float32, float64, float16, bfloat16, int8, uint8, int32, int64");
  ST_CHECK_ARG(t.is_contiguous(), op, " on group '", name_, "': tensor must be contiguous");
}

WorkPtr NcclCommunicator::Launch(const char* opname, const std::vector<at::Tensor>& touched,
                                 const std::function<void(NcclState&, const std::string&)>& issue,
                                 const std::function<void()>& after, bool host_blocking) {
  NcclState& s = *state_;
  const std::string what = Describe(opname);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
  const c10::cuda::CUDAStream comm_stream =
      c10::cuda::getStreamFromExternal(s.stream, static_cast<c10::DeviceIndex>(device_));

  std::lock_guard<std::mutex> lock(s.mu);
  if (s.aborted) {
    if (s.timed_out) ST_THROW(CommTimeoutError, what, " called on a failed communicator: ", s.error);
    ST_THROW(CommError, what, " called on a failed communicator: ", s.error);
  }
  auto op = std::make_shared<NcclOp>();
  op->seq = ++s.issued;
  op->title = opname;
  op->what = StrCat(what.substr(0, what.size() - 1), "; collective #", op->seq, " of this rank)");
  op->timeout = timeout_;
  ST_CUDA_CHECK(cudaEventCreateWithFlags(&op->done, cudaEventDisableTiming), what);
  // The collective starts after what the caller queued on its current stream.
  ST_CUDA_CHECK(cudaEventRecord(s.ready, compute.stream()), what);
  ST_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.ready, 0), what);
  op->deadline = Clock::now() + timeout_;
  try {
    issue(s, op->what);
  } catch (const CommError& e) {
    s.AbortLocked(e.what(), dynamic_cast<const CommTimeoutError*>(&e) != nullptr);
    throw;
  }
  if (after) {
    c10::cuda::CUDAStreamGuard stream_guard(comm_stream);
    after();
  }
  // The caching allocator must not reuse these blocks before the comm stream is done with them.
  for (const at::Tensor& t : touched) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), comm_stream);
  }
  ST_CUDA_CHECK(cudaEventRecord(op->done, s.stream), what);
  if (s.watch) {
    auto waiting = s.watch->Issue(op->seq, opname);  // the peers see it in this rank's next heartbeat
    if (watchdog_.joinable()) op->waiting = std::move(waiting);  // else a host-blocking Wait registers its wait
  }
  if (watchdog_.joinable()) s.pending.push_back(op);
  return std::make_shared<NcclWork>(state_, std::move(op), host_blocking || options_.blocking_wait);
}

WorkPtr NcclCommunicator::AllGather(const at::Tensor& input, const at::Tensor& output) {
  CheckTensor("AllGather", input);
  CheckTensor("AllGather", output);
  CheckGatherScatter("AllGather", input, output);
  Count(CommOp::kAllGather, (size_ - 1) * input.numel() * input.element_size());
  const ncclDataType_t dtype = *NcclType(input.scalar_type());
  const std::chrono::milliseconds timeout = timeout_;
  return Launch(
      "AllGather", {input, output},
      [&](NcclState& s, const std::string& what) {
        const auto deadline = Clock::now() + timeout;
        ST_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()), dtype,
                                    s.comm, s.stream),
                      what);
        s.WaitReadyLocked(what, timeout, deadline);
      },
      nullptr, false);
}

WorkPtr NcclCommunicator::ReduceScatter(const at::Tensor& input, const at::Tensor& output,
                                        const ReduceOptions& options) {
  CheckTensor("ReduceScatter", input);
  CheckTensor("ReduceScatter", output);
  CheckGatherScatter("ReduceScatter", output, input);
  const Reduction red = MakeReduction("ReduceScatter", name_, size_, options, output.scalar_type());
  Count(CommOp::kReduceScatter, (size_ - 1) * output.numel() * output.element_size());
  const ncclDataType_t dtype = *NcclType(output.scalar_type());
  const std::chrono::milliseconds timeout = timeout_;
  return Launch(
      "ReduceScatter", {input, output},
      [&](NcclState& s, const std::string& what) {
        IssueReduction(s, what, timeout, Clock::now() + timeout, red, dtype, [&](ncclRedOp_t op) {
          return ncclReduceScatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()), dtype,
                                   op, s.comm, s.stream);
        });
      },
      red.post_divisor != 1.0 ? std::function<void()>([&] { output.div_(red.post_divisor); }) : nullptr, false);
}

WorkPtr NcclCommunicator::AllReduce(const at::Tensor& tensor, const ReduceOptions& options) {
  CheckTensor("AllReduce", tensor);
  const Reduction red = MakeReduction("AllReduce", name_, size_, options, tensor.scalar_type());
  Count(CommOp::kAllReduce, 2 * (size_ - 1) * tensor.numel() * tensor.element_size() / size_);
  const ncclDataType_t dtype = *NcclType(tensor.scalar_type());
  const std::chrono::milliseconds timeout = timeout_;
  return Launch(
      "AllReduce", {tensor},
      [&](NcclState& s, const std::string& what) {
        IssueReduction(s, what, timeout, Clock::now() + timeout, red, dtype, [&](ncclRedOp_t op) {
          return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), dtype, op,
                               s.comm, s.stream);
        });
      },
      red.post_divisor != 1.0 ? std::function<void()>([&] { tensor.div_(red.post_divisor); }) : nullptr, false);
}

WorkPtr NcclCommunicator::Broadcast(const at::Tensor& tensor, int root) {
  CheckTensor("Broadcast", tensor);
  ST_CHECK_ARG(root >= 0 && root < size_, "Broadcast on group '", name_, "': root must be in [0, ", size_, "), got ",
               root);
  // As the Gloo backend: the root is charged (W-1) copies.
  Count(CommOp::kBroadcast, rank_ == root ? (size_ - 1) * tensor.numel() * tensor.element_size() : 0);
  const ncclDataType_t dtype = *NcclType(tensor.scalar_type());
  const std::chrono::milliseconds timeout = timeout_;
  return Launch(
      "Broadcast", {tensor},
      [&](NcclState& s, const std::string& what) {
        const auto deadline = Clock::now() + timeout;
        ST_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), dtype,
                                    root, s.comm, s.stream),
                      what);
        s.WaitReadyLocked(what, timeout, deadline);
      },
      nullptr, false);
}

WorkPtr NcclCommunicator::Barrier() {
  if (!barrier_buffer_.defined()) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    // empty: no kernel on whatever stream is current now; the value is never read.
    barrier_buffer_ = at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
  }
  Count(CommOp::kBarrier, 2 * (size_ - 1) * static_cast<int64_t>(sizeof(float)) / size_);
  const at::Tensor buf = barrier_buffer_;
  const std::chrono::milliseconds timeout = timeout_;
  return Launch(
      "Barrier", {buf},
      [&](NcclState& s, const std::string& what) {
        const auto deadline = Clock::now() + timeout;
        ST_NCCL_CHECK(ncclAllReduce(buf.data_ptr(), buf.data_ptr(), 1, ncclFloat32, ncclSum, s.comm, s.stream), what);
        s.WaitReadyLocked(what, timeout, deadline);
      },
      nullptr, /*host_blocking=*/true);
}

CommunicatorPtr NcclCommunicator::NewGroup(const std::vector<int>& ranks, const std::string& name) {
  int id = 0;
  const int index = PrepareNewGroup(ranks, name, &id);
  if (index < 0) return nullptr;
  NcclOptions o = options_;
  o.name = name_ + "/" + name;
  o.device = device_;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("group" + std::to_string(id) + "/" + name, store_);
  return Create(prefixed, index, static_cast<int>(ranks.size()), o);
}

}  // namespace shardtrain::comm
