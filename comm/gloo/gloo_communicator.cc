// GlooCommunicator's public operations: construction (c10d ProcessGroupGloo,
// shared memory, heartbeats), argument checks, the choice of path for each
// collective (shared memory, W=2 exchange, or Gloo's general algorithm) and
// the Work wrapping of c10d's. The parts it calls are described in
// internal/common.h.
#include "comm/gloo_communicator.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/errors.h"
#include "base/logging.h"
#include "base/time_text.h"
#include "comm/gloo/internal/call_issuer.h"
#include "comm/gloo/internal/common.h"
#include "comm/gloo/internal/gloo_work.h"
#include "comm/gloo/internal/mesh_collectives.h"
#include "comm/gloo/internal/pair_exchange.h"
#include "comm/gloo/internal/peer_monitor.h"
#include "comm/gloo/shared_memory_mesh.h"
#include "comm/heartbeat_store.h"
#include "comm/net_address.h"
#include "comm/peer_watch.h"
#include "comm/rendezvous.h"
#include "comm/wait_time.h"

namespace shardtrain::comm {
namespace gloo_internal {

const char* OpTitle(CommOp op) {
  static constexpr const char* kTitles[] = {"AllGather", "ReduceScatter", "AllReduce", "Broadcast", "Barrier"};
  const int i = static_cast<int>(op);
  return i >= 0 && i < static_cast<int>(CommOp::kCount) ? kTitles[i] : "?";
}

std::string ErrorText(const std::exception& e) {
  const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
  std::string text = ce ? ce->what_without_backtrace() : e.what();
  const size_t nl = text.find('\n');
  return nl == std::string::npos ? text : text.substr(0, nl);
}

std::string Describe(const char* op, const GlooGroupRef& g) {
  return internal::StrCat(op, " on gloo group '", g.name, "' (rank ", g.rank, "/", g.size, ")");
}

SharedMemoryMesh::Consumer CopyInto(uint8_t* out, std::vector<int64_t> starts) {
  return [out, starts = std::move(starts)](int peer, int64_t offset, const uint8_t* data, int64_t len) {
    std::memcpy(out + starts[peer] + offset, data, len);
    return len;
  };
}

std::string FailureText(const GlooGroupRef& g, CommOp op, IssuedCall call, bool timed_out,
                        std::chrono::milliseconds timeout, const char* engine, const std::string& detail) {
  std::string why = g.monitor ? g.monitor->Diagnose(call.seq, call.wall_ms, OpTitle(op), timed_out) : "";
  if (why.empty()) why = "a peer rank may have died or not reached this collective";
  return internal::StrCat(Describe(OpTitle(op), g),
                          timed_out ? " timed out after " + std::to_string(timeout.count()) + " ms" : " failed",
                          " (collective #", call.seq, " of this rank): ", why, ". ", engine, ": ",
                          detail.substr(0, 600));
}

void GlooWork::Wait(std::chrono::milliseconds timeout) {
  WaitTimer blocked;  // for profilers (comm/wait_time.h)
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return;
  if (!error_.empty()) {
    if (timed_out_) ST_THROW(CommTimeoutError, error_);
    ST_THROW(CommError, error_);
  }
  const auto t = timeout.count() > 0 ? timeout : timeout_;
  try {
    PeerWatch::Wait(group_->watch.get(), call_.seq, OpTitle(op_), t, [&](auto slice) { work_->wait(slice); },
                    [&] { return work_->isCompleted(); });
  } catch (const CommTimeoutError& e) {  // a stalled peer (GlooOptions::stall_timeout)
    error_ = e.what();
    timed_out_ = true;
    throw;
  } catch (const std::exception& e) {
    const std::string msg = ErrorText(e);
    timed_out_ = msg.find("imed out") != std::string::npos || msg.find("imeout") != std::string::npos;
    error_ = FailureText(*group_, op_, call_, timed_out_, t, "Gloo", msg);
    if (timed_out_) ST_THROW(CommTimeoutError, error_);
    ST_THROW(CommError, error_);
  }
  if (finish_) finish_();
  done_ = true;
}

namespace {

bool IsSupportedDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kInt: case at::kLong: case at::kChar: case at::kByte: case at::kBool:
      return true;
    default:
      return false;
  }
}

// Where Gloo listens by default: the local address that reaches the store's
// host (TCPStore or ours; loopback when that is loopback), as the store itself binds to it;
// loopback for a HashStore (threads of one process); "" (the hostname's
// address) for a FileStore, whose ranks may span hosts on a shared filesystem.
std::string ListenAddressFor(const c10::intrusive_ptr<c10d::Store>& store) {
  if (auto server = TcpStoreAddress(store)) return LocalAddressToward(server->host);  // TCPStore or ours
  c10d::Store* base = store.get();
  if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(base)) base = prefixed->getUnderlyingNonPrefixStore().get();
  if (dynamic_cast<c10d::HashStore*>(base)) return "127.0.0.1";
  return "";
}

}  // namespace
}  // namespace gloo_internal

using gloo_internal::Is16Bit;
using gloo_internal::IsFloating;
using gloo_internal::OpTitle;
using gloo_internal::SteadyClock;

GlooCommunicator::GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, GlooOptions options)
    : Communicator(rank, size, options.name, options.timeout), store_(std::move(store)), options_(std::move(options)) {
  // c10d's process-wide flight recorder (a debugging trace of collectives)
  // corrupts its maps when several process groups in one process record at
  // once (threads-as-ranks, sub-groups used from autograd threads). It is off
  // unless the user asks for it with TORCH_FR_BUFFER_SIZE.
  static const bool fr_configured = [] { return setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0; }();
  (void)fr_configured;
  ST_CHECK_ARG(options_.threads >= 1, "GlooOptions.threads must be >= 1, got ", options_.threads);
  ST_CHECK_ARG(options_.heartbeat_period.count() >= 0, "GlooOptions.heartbeat_period must be >= 0 ms (0: off), got ",
               options_.heartbeat_period.count(), " ms");
  CheckStallOptions(options_.stall_warning, options_.stall_timeout);
  ST_CHECK_ARG(options_.shared_memory_ring_bytes >= 4096 && options_.shared_memory_ring_bytes % 4096 == 0,
               "GlooOptions.shared_memory_ring_bytes must be a positive multiple of 4096, got ",
               options_.shared_memory_ring_bytes);
  auto opts = c10d::ProcessGroupGloo::Options::create(options_.timeout);
  try {
    if (!options_.hostname.empty()) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options_.hostname));
    } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (const std::string addr = gloo_internal::ListenAddressFor(store_); !addr.empty()) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(addr));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    opts->threads = options_.threads;
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank, size, opts);
    ConnectSharedMemory();
    if (options_.verify_calls && size > 1 && !mesh_) {
      // The signature exchange gets its own connections and worker thread:
      // on pg_ it would queue behind the collectives still in flight, and the
      // caller would block until they finished (no overlap with compute).
      auto verify_opts = c10d::ProcessGroupGloo::Options::create(options_.timeout);
      verify_opts->devices = opts->devices;
      verify_opts->threads = 1;
      verify_pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("verify", store_), rank, size, verify_opts);
    }
  } catch (const std::exception& e) {
    ST_THROW(CommError, "connecting gloo group '", name_, "' (rank ", rank, "/", size, ") failed within ",
             options_.timeout.count(), " ms: ", e.what());
  }
  if (size_ > 1 && options_.heartbeat_period.count() > 0) {
    monitor_ = std::make_shared<GlooPeerMonitor>(MakeHeartbeatStore(store_), name_, rank_, size_, options_.heartbeat_period);
    if (mesh_) {  // exact counts of the peers, even of a stopped one
      monitor_->SetLocalProgress([mesh = mesh_.get()](int r) -> std::optional<std::pair<int64_t, const char*>> {
        const auto p = mesh->PeerProgress(r);
        if (!p) return std::nullopt;
        return std::make_pair(p->issued, OpTitle(static_cast<CommOp>(p->op)));
      });
    }
    monitor_->Start();
  }
  std::shared_ptr<PeerWatch> watch;
  if (monitor_ && (options_.stall_warning.count() > 0 || options_.stall_timeout.count() > 0)) {
    watch = std::make_shared<PeerWatch>(PeerWatchOptions{name_, rank_, size_, options_.heartbeat_period,
                                                         options_.stall_warning, options_.stall_timeout},
                                        BeatReader(monitor_));
    if (mesh_) watch->OnStallFailure([mesh = mesh_.get()] { mesh->Abort(); });
  }
  group_ = std::make_shared<const GlooGroupRef>(GlooGroupRef{name_, rank_, size_, monitor_, watch});
  if (verify_pg_ || mesh_) issuer_ = std::make_unique<GlooCallIssuer>();
}

void GlooCommunicator::ConnectSharedMemory() {
  if (size_ < 2) return;
  const char* env = std::getenv("SHARDTRAIN_GLOO_SHM");
  const bool wanted = options_.shared_memory && !(env && std::string(env) == "0");
  MeshRendezvous rendezvous;
  rendezvous.set = [this](const std::string& key, const std::string& value) {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  };
  rendezvous.get = [this](const std::string& key) {
    const std::vector<uint8_t> v = store_->get(key);
    return std::string(v.begin(), v.end());
  };
  rendezvous.add = [this](const std::string& key, int64_t delta) { return store_->add(key, delta); };
  // Every rank takes part, wanted or not, so that all agree on the outcome.
  std::string why_not;
  mesh_ = SharedMemoryMesh::Connect(rendezvous, rank_, size_, wanted, options_.shared_memory_ring_bytes, &why_not);
  if (!mesh_ && wanted) {
    ST_LOG(WARNING) << "gloo group '" << name_ << "' (rank " << rank_ << "/" << size_
                    << "): not using shared memory (" << why_not << "); collectives go through Gloo's TCP connections";
  }
}

GlooCommunicator::~GlooCommunicator() {
  if (group_ && group_->watch) {
    group_->watch->Stop();  // before mesh_ goes (its stall callback)
    if (!group_->watch->Failure().empty()) {
      // A stalled peer failed the group (GlooOptions::stall_timeout): Gloo's
      // worker threads may wait on it until `timeout`, and destroying the
      // process groups would join them. Leave them to the process's exit.
      (void)pg_.release();
      (void)verify_pg_.release();
    }
  }
  if (mesh_) {
    // Peers waiting on this rank fail at once (and can read why from the
    // "closed" heartbeat); so does a transfer of this rank in progress.
    if (monitor_) monitor_->Stop();
    mesh_->Abort();
  }
  issuer_.reset();  // calls not started yet fail; one being started finishes first
  // The "closed" heartbeat goes out before pg_ (destroyed after this body)
  // closes the connections, so peers that fail on them can tell why.
  if (monitor_) monitor_->Stop();
}

std::shared_ptr<GlooCommunicator> GlooCommunicator::Create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                           GlooOptions options) {
  ST_CHECK_ARG(store, "GlooCommunicator::Create needs a rendezvous store");
  return std::shared_ptr<GlooCommunicator>(new GlooCommunicator(std::move(store), rank, size, std::move(options)));
}

void GlooCommunicator::CheckCpu(const char* op, const at::Tensor& t) const {
  ST_CHECK_ARG(t.defined(), op, " on group '", name_, "': tensor must be defined");
  ST_CHECK_ARG(t.device().is_cpu(), op, " on gloo group '", name_, "': tensors must be on the CPU, got ", t.device(),
               " (use the nccl backend for CUDA tensors)");
  ST_CHECK_ARG(gloo_internal::IsSupportedDtype(t.scalar_type()), op, " on gloo group '", name_, "': unsupported dtype ",
               t.scalar_type(), "; valid: float32, float64, float16, bfloat16, int8/uint8/int32/int64, bool");
  ST_CHECK_ARG(t.is_contiguous(), op, " on group '", name_, "': tensor must be contiguous");
}

IssuedCall GlooCommunicator::Issue(CommOp op) {
  IssuedCall call{++issued_, monitor_ ? WallClockMs() : 0};
  if (monitor_) monitor_->Note(call.seq, OpTitle(op));
  if (mesh_) mesh_->NoteProgress(call.seq, static_cast<int>(op));
  return call;
}

WorkPtr GlooCommunicator::RunOnMesh(CommOp op, IssuedCall call,
                                    const std::function<void(SteadyClock::time_point deadline)>& transfer) {
  try {
    PeerWatch::Waiting waiting(group_->watch.get(), call.seq, OpTitle(op));
    transfer(SteadyClock::now() + timeout_);
  } catch (const SharedMemoryError& e) {
    if (std::string f = group_->watch ? group_->watch->Failure() : ""; !f.empty()) throw CommTimeoutError(f);
    const bool timed_out = e.kind() == SharedMemoryError::Kind::kTimeout;
    const std::string text = gloo_internal::FailureText(*group_, op, call, timed_out, timeout_, "Shared memory", e.what());
    if (timed_out) ST_THROW(CommTimeoutError, text);
    ST_THROW(CommError, text);
  }
  return CompletedWork();
}

WorkPtr GlooCommunicator::Wrap(c10::intrusive_ptr<c10d::Work> work, CommOp op, IssuedCall call,
                               std::function<void()> finish) {
  return std::make_shared<gloo_internal::GlooWork>(std::move(work), group_, op, call, timeout_, std::move(finish));
}

WorkPtr GlooCommunicator::AllGather(const at::Tensor& input, const at::Tensor& output) {
  CheckCpu("AllGather", input);
  CheckCpu("AllGather", output);
  CheckGatherScatter("AllGather", input, output);
  const IssuedCall call = Issue(CommOp::kAllGather);
  Count(CommOp::kAllGather, (size_ - 1) * input.numel() * input.element_size());
  if (size_ == 1) {
    output.copy_(input);
    return CompletedWork();
  }
  return Submit(CommOp::kAllGather, input, 0, call,
                [this, input, output, call] { return StartAllGather(input, output, call); });
}

WorkPtr GlooCommunicator::StartAllGather(const at::Tensor& input, const at::Tensor& output, IssuedCall call) {
  if (mesh_) {
    return RunOnMesh(CommOp::kAllGather, call,
                     [&](SteadyClock::time_point deadline) { gloo_internal::MeshAllGather(*mesh_, input, output, deadline); });
  }
  if (size_ == 2 && input.numel() > 0) {  // W=2 fast path (pair_exchange.cc); taken on both ranks alike
    return Wrap(gloo_internal::PairAllGather(*pg_, rank_, input, output, timeout_), CommOp::kAllGather, call);
  }
  at::Tensor in = input, out = output;
  return Wrap(pg_->_allgather_base(out, in), CommOp::kAllGather, call);
}

WorkPtr GlooCommunicator::ReduceScatter(const at::Tensor& input, const at::Tensor& output,
                                        const ReduceOptions& options) {
  CheckCpu("ReduceScatter", input);
  CheckCpu("ReduceScatter", output);
  CheckGatherScatter("ReduceScatter", output, input);
  const double scale = ReduceScatterScale(options);
  const IssuedCall call = Issue(CommOp::kReduceScatter);
  Count(CommOp::kReduceScatter, (size_ - 1) * output.numel() * output.element_size());
  if (size_ == 1) {  // the general path's arithmetic (a sum over one block, from +0)
    const at::Tensor blocks = input.reshape({1, -1});
    at::Tensor sum = Is16Bit(output.scalar_type()) ? blocks.sum(0, false, at::kFloat) : blocks.sum(0);
    if (scale != 1.0) sum.mul_(scale);
    output.copy_(sum.view_as(output));
    return CompletedWork();
  }
  return Submit(CommOp::kReduceScatter, output, static_cast<int64_t>(options.op), call,
                [this, input, output, scale, call] { return StartReduceScatter(input, output, scale, call); });
}

double GlooCommunicator::ReduceScatterScale(const ReduceOptions& options) const {
  ST_CHECK_ARG(options.op == ReduceOp::kSum || options.op == ReduceOp::kAvg, "ReduceScatter on group '", name_,
               "': unsupported op ", ReduceOpName(options.op), "; valid: SUM, AVG");
  ST_CHECK_ARG(options.pre_divide > 0 && options.post_divide > 0, "ReduceScatter: divide factors must be > 0");
  return 1.0 / (options.pre_divide * options.post_divide * (options.op == ReduceOp::kAvg ? size_ : 1));
}

WorkPtr GlooCommunicator::ReduceScatterPieces(const std::vector<at::Tensor>& pieces, const at::Tensor& output,
                                              const ReduceOptions& options) {
  if (!mesh_ || !IsFloating(output.scalar_type())) return Communicator::ReduceScatterPieces(pieces, output, options);
  CheckPieces(pieces, output);
  CheckCpu("ReduceScatterPieces", output);
  const double scale = ReduceScatterScale(options);
  const IssuedCall call = Issue(CommOp::kReduceScatter);
  Count(CommOp::kReduceScatter, (size_ - 1) * output.numel() * output.element_size());
  return Submit(CommOp::kReduceScatter, output, static_cast<int64_t>(options.op), call,
                [this, pieces, output, scale, call] {
                  return RunOnMesh(CommOp::kReduceScatter, call, [&](SteadyClock::time_point deadline) {
                    gloo_internal::MeshReduceScatterPieces(*mesh_, pieces, output, scale, deadline);
                  });
                });
}

WorkPtr GlooCommunicator::StartReduceScatter(const at::Tensor& input, const at::Tensor& output, double scale,
                                             IssuedCall call) {
  const int64_t n = output.numel();
  const int world = size_;
  if (mesh_ && IsFloating(output.scalar_type())) {
    return RunOnMesh(CommOp::kReduceScatter, call, [&](SteadyClock::time_point deadline) {
      gloo_internal::MeshReduceScatter(*mesh_, input, output, scale, deadline);
    });
  }
  if (size_ == 2 && n > 0 && IsFloating(output.scalar_type())) {  // W=2 fast path (pair_exchange.cc); both ranks alike
    return Wrap(gloo_internal::PairReduceScatter(*pg_, rank_, input, output, scale, timeout_), CommOp::kReduceScatter,
                call);
  }
  // Every rank sends block j of its input to rank j, then sums what it got.
  at::Tensor recv = at::empty_like(input);
  auto finish = [recv, output, n, world, scale]() mutable {
    at::Tensor blocks = recv.view({world, n});
    at::Tensor sum = Is16Bit(output.scalar_type()) ? blocks.sum(0, false, at::kFloat) : blocks.sum(0);
    if (scale != 1.0) sum.mul_(scale);
    output.copy_(sum);
  };
  at::Tensor in = input;
  std::vector<int64_t> counts;  // empty: equal splits
  return Wrap(pg_->alltoall_base(recv, in, counts, counts), CommOp::kReduceScatter, call, std::move(finish));
}

WorkPtr GlooCommunicator::AllReduce(const at::Tensor& tensor, const ReduceOptions& options) {
  CheckCpu("AllReduce", tensor);
  ST_CHECK_ARG(options.pre_divide > 0 && options.post_divide > 0, "AllReduce: divide factors must be > 0");
  const IssuedCall call = Issue(CommOp::kAllReduce);
  Count(CommOp::kAllReduce, size_ == 1 ? 0 : 2 * (size_ - 1) * tensor.numel() * tensor.element_size() / size_);
  const bool is_sum = options.op == ReduceOp::kSum || options.op == ReduceOp::kAvg;
  if (is_sum && options.pre_divide != 1.0) tensor.div_(options.pre_divide);
  const double post = is_sum ? options.post_divide * (options.op == ReduceOp::kAvg ? size_ : 1) : 1.0;
  auto finish = [tensor, post]() {
    if (post != 1.0) tensor.div_(post);
  };
  if (size_ == 1) {
    finish();
    return CompletedWork();
  }
  return Submit(CommOp::kAllReduce, tensor, static_cast<int64_t>(options.op), call,
                [this, tensor, op = options.op, post, call] { return StartAllReduce(tensor, op, post, call); });
}

WorkPtr GlooCommunicator::StartAllReduce(const at::Tensor& tensor, ReduceOp op, double post, IssuedCall call) {
  const bool is_sum = op == ReduceOp::kSum || op == ReduceOp::kAvg;
  auto finish = [tensor, post]() {
    if (post != 1.0) tensor.div_(post);
  };
  if (mesh_ && is_sum && IsFloating(tensor.scalar_type())) {
    return RunOnMesh(CommOp::kAllReduce, call,
                     [&](SteadyClock::time_point deadline) { gloo_internal::MeshAllReduce(*mesh_, tensor, post, deadline); });
  }
  const int64_t bytes = tensor.numel() * tensor.element_size();
  if (size_ == 2 && is_sum && bytes > 0 && bytes <= gloo_internal::kDirectAllReduceMaxBytes &&
      IsFloating(tensor.scalar_type())) {
    // W=2 fast path for small tensors (pair_exchange.cc); both ranks alike.
    return Wrap(gloo_internal::PairAllReduce(*pg_, rank_, tensor, post, timeout_), CommOp::kAllReduce, call);
  }
  c10d::AllreduceOptions o;
  o.reduceOp = op == ReduceOp::kMax   ? c10d::ReduceOp(c10d::ReduceOp::MAX)
               : op == ReduceOp::kMin ? c10d::ReduceOp(c10d::ReduceOp::MIN)
                                              : c10d::ReduceOp(c10d::ReduceOp::SUM);
  o.timeout = timeout_;
  std::vector<at::Tensor> tensors{tensor};
  return Wrap(pg_->allreduce(tensors, o), CommOp::kAllReduce, call, std::move(finish));
}

WorkPtr GlooCommunicator::Broadcast(const at::Tensor& tensor, int root) {
  CheckCpu("Broadcast", tensor);
  ST_CHECK_ARG(root >= 0 && root < size_, "Broadcast on group '", name_, "': root must be in [0, ", size_, "), got ",
               root);
  const IssuedCall call = Issue(CommOp::kBroadcast);
  Count(CommOp::kBroadcast, rank_ == root ? (size_ - 1) * tensor.numel() * tensor.element_size() : 0);
  if (size_ == 1) return CompletedWork();
  return Submit(CommOp::kBroadcast, tensor, root, call, [this, tensor, root, call] {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = timeout_;
    std::vector<at::Tensor> tensors{tensor};
    return Wrap(pg_->broadcast(tensors, o), CommOp::kBroadcast, call);
  });
}

WorkPtr GlooCommunicator::Barrier() {
  const IssuedCall call = Issue(CommOp::kBarrier);
  Count(CommOp::kBarrier, 0);
  if (size_ == 1) return CompletedWork();
  return Submit(CommOp::kBarrier, at::Tensor(), 0, call, [this, call] {
    c10d::BarrierOptions o;
    o.timeout = timeout_;
    return Wrap(pg_->barrier(o), CommOp::kBarrier, call);
  });
}

CommunicatorPtr GlooCommunicator::NewGroup(const std::vector<int>& ranks, const std::string& name) {
  int id = 0;
  const int index = PrepareNewGroup(ranks, name, &id);
  if (index < 0) return nullptr;
  GlooOptions o = options_;
  o.name = name_ + "/" + name;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("group" + std::to_string(id) + "/" + name, store_);
  return Create(prefixed, index, static_cast<int>(ranks.size()), o);
}

}  // namespace shardtrain::comm
