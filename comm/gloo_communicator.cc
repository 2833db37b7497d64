#include "comm/gloo_communicator.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <sstream>

#include "comm/errors.h"

namespace shardtrain::comm {
namespace {

// Wraps a c10d Work: turns engine errors into CommError naming the operation
// and group, and runs a local completion step (unpacking, local sums, scaling)
// exactly once after the collective finished.
class GlooWork : public Work {
 public:
  GlooWork(c10::intrusive_ptr<c10d::Work> work, std::string what, std::chrono::milliseconds timeout,
           std::function<void()> finish)
      : work_(std::move(work)), what_(std::move(what)), timeout_(timeout), finish_(std::move(finish)) {}

  void Wait(std::chrono::milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    if (!error_.empty()) ST_THROW(CommError, error_);
    const auto t = timeout.count() > 0 ? timeout : timeout_;
    try {
      try {
        work_->wait(t);
      } catch (const c10::Error& e) {
        throw std::runtime_error(e.what_without_backtrace());
      }
    } catch (const std::exception& e) {
      std::string msg = e.what();
      const bool timed_out = msg.find("imed out") != std::string::npos || msg.find("imeout") != std::string::npos;
      error_ = what_ + (timed_out ? " timed out after " + std::to_string(t.count()) + " ms" : " failed") +
               " (a peer rank may have died or not reached this collective): " + msg.substr(0, 600);
      if (timed_out) ST_THROW(CommTimeoutError, error_);
      ST_THROW(CommError, error_);
    }
    if (finish_) finish_();
    done_ = true;
  }

  bool IsCompleted() override { return work_->isCompleted(); }

 private:
  std::mutex mu_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::function<void()> finish_;
  bool done_ = false;
  std::string error_;
};

bool IsSupportedDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kInt: case at::kLong: case at::kChar: case at::kByte: case at::kBool:
      return true;
    default:
      return false;
  }
}

}  // namespace

GlooCommunicator::GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, GlooOptions options)
    : Communicator(rank, size, options.name, options.timeout), store_(std::move(store)), options_(std::move(options)) {
  // c10d's process-wide flight recorder (a debugging trace of collectives)
  // corrupts its maps when several process groups in one process record at
  // once (threads-as-ranks, sub-groups used from autograd threads). It is off
  // unless the user asks for it with TORCH_FR_BUFFER_SIZE.
  static const bool fr_configured = [] { return setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0; }();
  (void)fr_configured;
  ST_CHECK_ARG(options_.threads >= 1, "GlooOptions.threads must be >= 1, got ", options_.threads);
  auto opts = c10d::ProcessGroupGloo::Options::create(options_.timeout);
  try {
    if (!options_.hostname.empty()) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options_.hostname));
    } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    opts->threads = options_.threads;
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank, size, opts);
  } catch (const std::exception& e) {
    ST_THROW(CommError, "connecting gloo group '", name_, "' (rank ", rank, "/", size, ") failed within ",
             options_.timeout.count(), " ms: ", e.what());
  }
}

GlooCommunicator::~GlooCommunicator() = default;

std::shared_ptr<GlooCommunicator> GlooCommunicator::Create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                           GlooOptions options) {
  ST_CHECK_ARG(store, "GlooCommunicator::Create needs a rendezvous store");
  return std::shared_ptr<GlooCommunicator>(new GlooCommunicator(std::move(store), rank, size, std::move(options)));
}

void GlooCommunicator::CheckCpu(const char* op, const at::Tensor& t) const {
  ST_CHECK_ARG(t.defined(), op, " on group '", name_, "': tensor must be defined");
  ST_CHECK_ARG(t.device().is_cpu(), op, " on gloo group '", name_, "': tensors must be on the CPU, got ", t.device(),
               " (use the nccl backend for CUDA tensors)");
  ST_CHECK_ARG(IsSupportedDtype(t.scalar_type()), op, " on gloo group '", name_, "': unsupported dtype ",
               t.scalar_type(), "; valid: float32, float64, float16, bfloat16, int8/uint8/int32/int64, bool");
  ST_CHECK_ARG(t.is_contiguous(), op, " on group '", name_, "': tensor must be contiguous");
}

static std::string Describe(const char* op, const Communicator& c) {
  return internal::StrCat(op, " on gloo group '", c.name(), "' (rank ", c.rank(), "/", c.size(), ")");
}

void GlooCommunicator::VerifySameCall(CommOp op, const at::Tensor& t, int64_t root) {
  if (!options_.verify_calls || size_ == 1) return;
  at::Tensor mine = at::empty({4}, at::kLong);
  mine[0] = static_cast<int64_t>(op);
  mine[1] = t.defined() ? t.numel() : 0;
  mine[2] = t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1;
  mine[3] = root;
  at::Tensor all = at::empty({4 * size_}, at::kLong);
  static constexpr const char* kTitles[] = {"AllGather", "ReduceScatter", "AllReduce", "Broadcast", "Barrier"};
  GlooWork(pg_->_allgather_base(all, mine), Describe(kTitles[static_cast<int>(op)], *this), timeout_, nullptr)
      .Wait(std::chrono::milliseconds(0));
  auto a = all.accessor<int64_t, 1>();
  bool same = true;
  for (int r = 0; r < size_ && same; ++r)
    for (int k = 0; k < 4; ++k) same = same && a[4 * r + k] == a[k];
  if (same) return;
  std::ostringstream os;
  for (int r = 0; r < size_; ++r) {
    os << (r ? "; " : "") << "rank " << r << ": " << CommOpName(static_cast<CommOp>(a[4 * r])) << " of " << a[4 * r + 1]
       << " x " << (a[4 * r + 2] >= 0 ? c10::toString(static_cast<at::ScalarType>(a[4 * r + 2])) : "none");
    if (a[4 * r] == static_cast<int64_t>(CommOp::kBroadcast)) os << " from root " << a[4 * r + 3];
  }
  ST_THROW(InvalidArgumentError, "ranks of gloo group '", name_,
           "' issued different collectives (every rank must make the same call with the same size and dtype): ",
           os.str());
}


// ---------------------------------------------------------------------------
// W=2 fast paths for AllGather and ReduceScatter (measured in bench/comm, see
// docs/comm_benchmark.md). At W=2 both ops are one exchange of n elements each
// way. The general paths below pay for c10d internals that dominate on large
// buffers: _allgather_base gathers into a freshly allocated full-size tensor
// and copies it into `output`; the all-to-all reduce-scatter receives into a
// fresh full-size tensor and reduces with blocks.sum(0) (very slow for 16-bit
// types); fresh buffers above glibc's mmap threshold are page-faulted in on
// every call. The fast paths instead exchange with c10d alltoall_base and
// split sizes {0, n} / {n, 0}: each rank sends n elements straight from the
// user's tensor and receives n straight into the user's output (so (W-1)/W of
// the full buffer, as counted), on Gloo's worker threads like every other op.
// All-gather is one such exchange; reduce-scatter is one per 4 MiB piece, and
// its Wait() adds (and scales) piece k while later pieces are still moving.
// The local steps (own shard copy; add of own block and scale) run on the
// calling thread in pieces of at most GRAIN_SIZE elements, so they never wake
// the OpenMP pool, whose spinning threads otherwise steal the cores Gloo's
// I/O needs on small machines.
namespace {

bool IsFloating(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Sends `send` (n elements) to the other rank of a 2-rank group and receives
// its n elements into `recv`.
c10::intrusive_ptr<c10d::Work> ExchangeWithPeer(c10d::Backend& pg, int rank, const at::Tensor& send,
                                                const at::Tensor& recv, std::chrono::milliseconds timeout) {
  const int64_t n = send.numel();
  // Separate vectors: c10d may move from its split-size arguments.
  std::vector<int64_t> send_splits = rank == 0 ? std::vector<int64_t>{0, n} : std::vector<int64_t>{n, 0};
  std::vector<int64_t> recv_splits = send_splits;
  at::Tensor in = send, out = recv;
  c10d::AllToAllOptions o;
  o.timeout = timeout;
  return pg.alltoall_base(out, in, recv_splits, send_splits, o);
}

// A W=2 reduce-scatter exchanged in pieces: wait() reduces piece k on the
// calling thread while Gloo's worker threads still move pieces k+1, ...
class PipelinedWork : public c10d::Work {
 public:
  PipelinedWork(std::vector<c10::intrusive_ptr<c10d::Work>> pieces, std::function<void(size_t)> on_piece)
      : pieces_(std::move(pieces)), on_piece_(std::move(on_piece)) {}
  bool isCompleted() override {
    return std::all_of(pieces_.begin(), pieces_.end(), [](const auto& w) { return w->isCompleted(); });
  }
  bool wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (; next_ < pieces_.size(); ++next_) {
      if (timeout == ::kNoTimeout) {
        pieces_[next_]->wait(timeout);
      } else {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        pieces_[next_]->wait(std::max(left, std::chrono::milliseconds(1)));
      }
      on_piece_(next_);
    }
    return true;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> pieces_;
  std::function<void(size_t)> on_piece_;
  size_t next_ = 0;
};

// Runs f(offset, length) over [0, n) in pieces small enough for ATen to run
// each on the calling thread.
template <typename F>
void Serially(int64_t n, F&& f) {
  for (int64_t i = 0; i < n; i += at::internal::GRAIN_SIZE) f(i, std::min<int64_t>(at::internal::GRAIN_SIZE, n - i));
}

}  // namespace
// ---------------------------------------------------------------------------

WorkPtr GlooCommunicator::AllGather(const at::Tensor& input, const at::Tensor& output) {
  CheckCpu("AllGather", input);
  CheckCpu("AllGather", output);
  CheckGatherScatter("AllGather", input, output);
  VerifySameCall(CommOp::kAllGather, input, 0);
  Count(CommOp::kAllGather, (size_ - 1) * input.numel() * input.element_size());
  if (size_ == 1) {
    output.copy_(input);
    return CompletedWork();
  }
  if (size_ == 2 && input.numel() > 0) {  // W=2 fast path (see above); taken on both ranks alike
    at::Tensor in = input.reshape(-1);
    const at::Tensor out = output.reshape(-1);
    const int64_t n = in.numel();
    const at::Tensor mine = out.narrow(0, rank_ * n, n), theirs = out.narrow(0, (1 - rank_) * n, n);
    // In place (`input` is this rank's block of `output`) needs no copy; any
    // other overlap sends from a copy.
    const bool in_place = in.data_ptr() == mine.data_ptr();
    if (!in_place && at::get_overlap_status(in, out) != at::MemOverlapStatus::No) in = in.clone();
    auto work = ExchangeWithPeer(*pg_, rank_, in, theirs, timeout_);
    if (!in_place) std::memcpy(mine.data_ptr(), in.data_ptr(), n * in.element_size());  // overlaps the exchange
    return std::make_shared<GlooWork>(work, Describe("AllGather", *this), timeout_, nullptr);
  }
  at::Tensor in = input, out = output;
  auto work = pg_->_allgather_base(out, in);
  return std::make_shared<GlooWork>(work, Describe("AllGather", *this), timeout_, nullptr);
}

WorkPtr GlooCommunicator::ReduceScatter(const at::Tensor& input, const at::Tensor& output,
                                        const ReduceOptions& options) {
  CheckCpu("ReduceScatter", input);
  CheckCpu("ReduceScatter", output);
  CheckGatherScatter("ReduceScatter", output, input);
  ST_CHECK_ARG(options.op == ReduceOp::kSum || options.op == ReduceOp::kAvg, "ReduceScatter on group '", name_,
               "': unsupported op ", ReduceOpName(options.op), "; valid: SUM, AVG");
  ST_CHECK_ARG(options.pre_divide > 0 && options.post_divide > 0, "ReduceScatter: divide factors must be > 0");
  VerifySameCall(CommOp::kReduceScatter, output, static_cast<int64_t>(options.op));
  Count(CommOp::kReduceScatter, (size_ - 1) * output.numel() * output.element_size());
  const double scale =
      1.0 / (options.pre_divide * options.post_divide * (options.op == ReduceOp::kAvg ? size_ : 1));
  const int64_t n = output.numel();
  const int world = size_;
  if (size_ == 2 && n > 0 && IsFloating(output.scalar_type())) {  // W=2 fast path (see above); both ranks alike
    // Send the peer's block of `input`, receive the peer's contribution to ours
    // (straight into `output` unless it aliases `input`), then add ours. Same
    // arithmetic as the general path, bit for bit (checked by comm_bench's
    // self-check): the sum of the two blocks, then the scale, in the dtype for
    // float32/float64; in float32 with one rounding at the end for 16-bit
    // types; the trailing add of +0 turns -0 into +0 and changes nothing else,
    // as the general path's sum (which starts from +0) does.
    at::Tensor in = input.reshape(-1);
    const at::Tensor out = output.reshape(-1);
    at::Tensor recv = out;
    if (at::get_overlap_status(in, out) != at::MemOverlapStatus::No) {
      if (out.data_ptr() == in.narrow(0, rank_ * n, n).data_ptr()) {
        recv = at::empty_like(out);  // in place: `output` is this rank's block of `input`
      } else {
        in = in.clone();
      }
    }
    const at::Tensor mine = in.narrow(0, rank_ * n, n), to_peer = in.narrow(0, (1 - rank_) * n, n);
    const bool low = out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16;
    // +0 as a 0-dim tensor: adding it is markedly faster than adding the Scalar 0.0.
    const at::Tensor zero = at::zeros({}, out.options().dtype(low && scale != 1.0 ? at::kFloat : out.scalar_type()));
    auto reduce = [out, recv, mine, scale, low, zero](int64_t begin, int64_t count) {
      Serially(count, [&](int64_t i, int64_t len) {
        at::Tensor o = out.narrow(0, begin + i, len), got = recv.narrow(0, begin + i, len);
        const at::Tensor m = mine.narrow(0, begin + i, len);
        if (!low || scale == 1.0) {
          at::add_out(o, got, m).add_(zero);
          if (scale != 1.0) o.mul_(scale);
        } else {
          at::Tensor acc = got.to(at::kFloat);
          acc.add_(m).add_(zero);
          acc.mul_(scale);
          o.copy_(acc);
        }
      });
    };
    // Exchanged in pieces of 4 MiB (of the output), so reducing one piece
    // overlaps moving the next ones; each piece is one alltoall_base.
    constexpr int64_t kPieceBytes = int64_t{4} << 20;
    const int64_t piece = std::max<int64_t>(1, kPieceBytes / output.element_size());
    std::vector<c10::intrusive_ptr<c10d::Work>> pieces;
    for (int64_t i = 0; i < n; i += piece) {
      const int64_t len = std::min(piece, n - i);
      pieces.push_back(ExchangeWithPeer(*pg_, rank_, to_peer.narrow(0, i, len), recv.narrow(0, i, len), timeout_));
    }
    auto on_piece = [reduce, piece, n](size_t k) {
      const int64_t begin = static_cast<int64_t>(k) * piece;
      reduce(begin, std::min(piece, n - begin));
    };
    return std::make_shared<GlooWork>(c10::make_intrusive<PipelinedWork>(std::move(pieces), std::move(on_piece)),
                                      Describe("ReduceScatter", *this), timeout_, nullptr);
  }
  // Every rank sends block j of its input to rank j, then sums what it got.
  at::Tensor recv = size_ == 1 ? input : at::empty_like(input);
  auto finish = [recv, output, n, world, scale]() mutable {
    at::Tensor blocks = recv.view({world, n});
    const bool low = output.scalar_type() == at::kHalf || output.scalar_type() == at::kBFloat16;
    at::Tensor sum = low ? blocks.sum(0, false, at::kFloat) : blocks.sum(0);
    if (scale != 1.0) sum.mul_(scale);
    output.copy_(sum);
  };
  if (size_ == 1) {
    finish();
    return CompletedWork();
  }
  at::Tensor in = input;
  std::vector<int64_t> counts;  // empty: equal splits
  auto work = pg_->alltoall_base(recv, in, counts, counts);
  return std::make_shared<GlooWork>(work, Describe("ReduceScatter", *this), timeout_, std::move(finish));
}

WorkPtr GlooCommunicator::AllReduce(const at::Tensor& tensor, const ReduceOptions& options) {
  CheckCpu("AllReduce", tensor);
  ST_CHECK_ARG(options.pre_divide > 0 && options.post_divide > 0, "AllReduce: divide factors must be > 0");
  VerifySameCall(CommOp::kAllReduce, tensor, static_cast<int64_t>(options.op));
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
  c10d::AllreduceOptions o;
  o.reduceOp = options.op == ReduceOp::kMax   ? c10d::ReduceOp(c10d::ReduceOp::MAX)
               : options.op == ReduceOp::kMin ? c10d::ReduceOp(c10d::ReduceOp::MIN)
                                              : c10d::ReduceOp(c10d::ReduceOp::SUM);
  o.timeout = timeout_;
  std::vector<at::Tensor> tensors{tensor};
  auto work = pg_->allreduce(tensors, o);
  return std::make_shared<GlooWork>(work, Describe("AllReduce", *this), timeout_, std::move(finish));
}

WorkPtr GlooCommunicator::Broadcast(const at::Tensor& tensor, int root) {
  CheckCpu("Broadcast", tensor);
  ST_CHECK_ARG(root >= 0 && root < size_, "Broadcast on group '", name_, "': root must be in [0, ", size_, "), got ",
               root);
  VerifySameCall(CommOp::kBroadcast, tensor, root);
  Count(CommOp::kBroadcast, rank_ == root ? (size_ - 1) * tensor.numel() * tensor.element_size() : 0);
  if (size_ == 1) return CompletedWork();
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = timeout_;
  std::vector<at::Tensor> tensors{tensor};
  auto work = pg_->broadcast(tensors, o);
  return std::make_shared<GlooWork>(work, Describe("Broadcast", *this), timeout_, nullptr);
}

WorkPtr GlooCommunicator::Barrier() {
  VerifySameCall(CommOp::kBarrier, at::Tensor(), 0);
  Count(CommOp::kBarrier, 0);
  if (size_ == 1) return CompletedWork();
  c10d::BarrierOptions o;
  o.timeout = timeout_;
  auto work = pg_->barrier(o);
  return std::make_shared<GlooWork>(work, Describe("Barrier", *this), timeout_, nullptr);
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
