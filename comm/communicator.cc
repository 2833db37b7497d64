#include "comm/communicator.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <sstream>

#include "base/errors.h"

namespace shardtrain::comm {

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kMin: return "MIN";
  }
  return "?";
}

const char* CommOpName(CommOp op) {
  switch (op) {
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kAllReduce: return "all_reduce";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kBarrier: return "barrier";
    case CommOp::kCount: break;
  }
  return "?";
}

int64_t CommStats::TotalBytesSent() const {
  int64_t total = 0;
  for (int64_t b : bytes_sent) total += b;
  return total;
}

std::string CommStats::ToString() const {
  std::ostringstream os;
  for (int i = 0; i < static_cast<int>(CommOp::kCount); ++i) {
    if (i) os << ", ";
    os << CommOpName(static_cast<CommOp>(i)) << ": " << calls[i] << " calls, " << bytes_sent[i] << " B";
  }
  return os.str();
}

namespace {
class DoneWork : public Work {
 public:
  void Wait(std::chrono::milliseconds) override {}
  bool IsCompleted() override { return true; }
};
}  // namespace

WorkPtr CompletedWork() { return std::make_shared<DoneWork>(); }

Communicator::Communicator(int rank, int size, std::string name, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), name_(std::move(name)), timeout_(timeout) {
  ST_CHECK_ARG(size >= 1, "world size must be >= 1, got ", size);
  ST_CHECK_ARG(rank >= 0 && rank < size, "rank must be in [0, ", size, "), got ", rank);
  ST_CHECK_ARG(timeout.count() > 0, "collective timeout must be positive, got ", timeout.count(), " ms");
}

void Communicator::Count(CommOp op, int64_t bytes_sent) {
  calls_[static_cast<int>(op)] += 1;
  bytes_[static_cast<int>(op)] += bytes_sent;
}

CommStats Communicator::stats() const {
  CommStats s;
  for (int i = 0; i < static_cast<int>(CommOp::kCount); ++i) {
    s.calls[i] = calls_[i].load();
    s.bytes_sent[i] = bytes_[i].load();
  }
  return s;
}

void Communicator::ResetStats() {
  for (int i = 0; i < static_cast<int>(CommOp::kCount); ++i) {
    calls_[i] = 0;
    bytes_[i] = 0;
  }
}

void Communicator::CheckGatherScatter(const char* op, const at::Tensor& shard, const at::Tensor& full) const {
  ST_CHECK_ARG(shard.defined() && full.defined(), op, " on group '", name_, "': tensors must be defined");
  ST_CHECK_ARG(shard.scalar_type() == full.scalar_type(), op, " on group '", name_,
               "': shard and full buffer must have the same dtype, got ", shard.scalar_type(), " and ",
               full.scalar_type());
  ST_CHECK_ARG(shard.device() == full.device(), op, " on group '", name_,
               "': shard and full buffer must be on the same device, got ", shard.device(), " and ", full.device());
  ST_CHECK_ARG(shard.is_contiguous() && full.is_contiguous(), op, " on group '", name_,
               "': tensors must be contiguous");
  ST_CHECK_ARG(full.numel() == shard.numel() * size_, op, " on group '", name_, "': the full buffer must have ",
               size_, " x shard elements = ", shard.numel() * size_, ", got ", full.numel(), " (shard has ",
               shard.numel(), ")");
}

void Communicator::CheckPieces(const std::vector<at::Tensor>& pieces, const at::Tensor& output) const {
  ST_CHECK_ARG(output.defined() && output.is_contiguous(), "ReduceScatterPieces on group '", name_,
               "': the output must be a defined, contiguous tensor");
  int64_t total = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const at::Tensor& p = pieces[i];
    ST_CHECK_ARG(p.defined() && p.is_contiguous() && p.scalar_type() == output.scalar_type() &&
                     p.device() == output.device(),
                 "ReduceScatterPieces on group '", name_, "': piece ", i,
                 " must be defined, contiguous and of the output's dtype and device (", output.scalar_type(), " on ",
                 output.device(), "), got ", p.defined() ? c10::toString(p.scalar_type()) : "undefined",
                 p.defined() && !p.is_contiguous() ? " (not contiguous)" : "");
    total += p.numel();
  }
  ST_CHECK_ARG(total == output.numel() * size_, "ReduceScatterPieces on group '", name_, "': the pieces must hold ",
               size_, " x output elements = ", output.numel() * size_, ", got ", total, " in ", pieces.size(),
               " pieces");
}

WorkPtr Communicator::ReduceScatterPieces(const std::vector<at::Tensor>& pieces, const at::Tensor& output,
                                          const ReduceOptions& options) {
  CheckPieces(pieces, output);
  std::vector<at::Tensor> flat;
  flat.reserve(pieces.size());
  for (const at::Tensor& p : pieces) flat.push_back(p.reshape(-1));
  const at::Tensor input = flat.empty() ? at::empty({0}, output.options()) : at::cat(flat);
  return ReduceScatter(input, output, options);
}

int Communicator::PrepareNewGroup(const std::vector<int>& ranks, const std::string& name, int* group_id) {
  ST_CHECK_ARG(!ranks.empty(), "NewGroup '", name, "': needs at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i) {
    ST_CHECK_ARG(ranks[i] >= 0 && ranks[i] < size_, "NewGroup '", name, "': rank ", ranks[i], " is not in [0, ", size_,
                 ")");
    ST_CHECK_ARG(i == 0 || ranks[i] > ranks[i - 1], "NewGroup '", name, "': ranks must be strictly ascending");
  }
  *group_id = next_group_++;
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

HybridGroups Communicator::SplitHybrid(int shard_size) {
  ST_CHECK_ARG(shard_size >= 1 && size_ % shard_size == 0, "HYBRID_SHARD: the shard group size must divide the world size ",
               size_, "; got ", shard_size);
  HybridGroups groups;
  const int num_shard_groups = size_ / shard_size;
  for (int g = 0; g < num_shard_groups; ++g) {
    std::vector<int> ranks;
    for (int i = 0; i < shard_size; ++i) ranks.push_back(g * shard_size + i);
    auto c = NewGroup(ranks, "shard" + std::to_string(g));
    if (c) groups.shard = c;
  }
  for (int i = 0; i < shard_size; ++i) {
    std::vector<int> ranks;
    for (int g = 0; g < num_shard_groups; ++g) ranks.push_back(g * shard_size + i);
    auto c = NewGroup(ranks, "replicate" + std::to_string(i));
    if (c) groups.replicate = c;
  }
  return groups;
}

}  // namespace shardtrain::comm
