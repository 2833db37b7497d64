// One rank's part of a sharded DCP save (trainer/connectors/internal/
// dcp_rank_writer.h): a rank's shard of a unit is a range of the unit's
// parameters laid end to end, and DCP stores boxes of each parameter's global
// shape, so the range is split into the boxes it covers.
#include "trainer/connectors/internal/dcp_rank_writer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "base/errors.h"
#include "strategies/strategy.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/connectors/internal/checkpoint_state.h"

namespace shardtrain::trainer::internal {

std::vector<dcp::PathPart> DcpArchivePath(int64_t rank) {
  return {{"shardtrain"}, {"optimizer_archive_" + std::to_string(rank)}};
}

std::vector<ShardPart> PartsInShard(const sharding::ShardedStateDict& sd, size_t u,
                                    const std::map<std::string, std::vector<int64_t>>& shapes) {
  const auto& unit = sd.units[u];
  const int64_t lo = sd.shard_rank * unit.shard_numel, hi = lo + unit.shard_numel;
  std::vector<ShardPart> out;
  int64_t at = 0;
  for (const auto& name : unit.param_names) {
    const std::vector<int64_t>& shape = shapes.at(name);
    const int64_t n = c10::multiply_integers(shape);
    const int64_t b = std::max(lo, at), e = std::min(hi, at + n);
    if (b < e) {
      ShardPart& p = out.emplace_back();
      p.name = name;
      p.shape = p.global_shape = shape;
      p.at = at;
      p.begin = b - at;
      p.end = e - at;
      const auto it = sd.pieces.find(name);
      if (it != sd.pieces.end()) {
        p.piece = it->second;
        p.global_shape = it->second.global_shape;
      }
    }
    at += n;
  }
  return out;
}

namespace {

// The boxes where `box` meets each block of `p`'s piece along its dimension:
// `from` is the side `box` is given in (stored or global).
std::vector<BoxPair> MapBlocks(const ShardPart& p, const dcp::Box& box, bool from_stored) {
  if (!p.piece) return {{box, box}};
  const int64_t d = p.piece->dim;
  std::vector<BoxPair> out;
  for (const sharding::GlobalPiece::Block& b : p.piece->blocks) {
    const int64_t begin = from_stored ? b.stored_begin : b.global_begin;
    const int64_t lo = std::max(box.offsets[d], begin), hi = std::min(box.offsets[d] + box.sizes[d], begin + b.length);
    if (lo >= hi) continue;
    BoxPair pair{box, box};
    pair.stored.offsets[d] = b.stored_begin + (lo - begin);
    pair.global.offsets[d] = b.global_begin + (lo - begin);
    pair.stored.sizes[d] = pair.global.sizes[d] = hi - lo;
    out.push_back(std::move(pair));
  }
  return out;
}

}  // namespace

std::vector<BoxPair> GlobalBoxes(const ShardPart& p, const dcp::Box& stored) { return MapBlocks(p, stored, true); }
std::vector<BoxPair> StoredBoxes(const ShardPart& p, const dcp::Box& global) { return MapBlocks(p, global, false); }

namespace {

// The unit of each optimized tensor from the parameter names it holds values
// of (Strategy::OptimizedParameterNames); empty when one has none.
std::vector<int> UnitOfTensors(const std::vector<std::vector<std::string>>& names,
                               const sharding::ShardedStateDict& sd) {
  std::map<std::string, int> unit_of_name;
  for (size_t u = 0; u < sd.units.size(); ++u) {
    for (const auto& n : sd.units[u].param_names) unit_of_name[n] = static_cast<int>(u);
  }
  std::vector<int> out;
  for (const auto& tensor_names : names) {
    auto it = tensor_names.empty() ? unit_of_name.end() : unit_of_name.find(tensor_names.front());
    if (it == unit_of_name.end()) return {};
    out.push_back(it->second);
  }
  return out;
}

}  // namespace

DcpRankWriter::DcpRankWriter(strategies::Strategy& s, torch::optim::Optimizer& opt, const std::string& path,
                             const std::vector<OptimizerGroup>& groups, bool background)
    : path_(path), rank_(s.rank()) {
  ST_CHECK_ARG(s.has_sharded_state(), "strategy '", s.name(), "' is not sharded: it cannot write sharded checkpoints");
  at::NoGradGuard no_grad;
  const sharding::ShardedStateDict sd = s.ShardedState();
  const auto shapes = StoredShapes(s);
  aliases_ = TiedAliases(s, sd);
  writes_whole_ = sd.writes_whole;
  for (const auto& g : groups) optimized_.insert(g.params.begin(), g.params.end());
  const std::string kind = OptimizerKind(opt);
  other_optimizer_ = kind.empty();
  const auto params = OptimizerParams(opt);
  const sharding::OptimizerStates states = other_optimizer_ ? sharding::OptimizerStates{} : StatesOf(opt, params);
  std::vector<int64_t> steps;
  if (!other_optimizer_) steps = s.ShardedOptimizerSteps(params, states);
  // HYBRID_SHARD and NO_SHARD replicas hold equal shards: the first replica
  // writes them, as DCP keeps one copy.
  if (sd.first_replica) {
    for (size_t u = 0; u < sd.units.size(); ++u) {
      Unit& unit = units_.emplace_back();
      unit.parts = PartsInShard(sd, u, shapes);
      // Tensor parallelism: the group's first rank writes the whole parameters.
      if (!writes_whole_) std::erase_if(unit.parts, [](const ShardPart& p) { return !p.piece; });
      unit.shard = sd.shards[u];  // the live shard
      unit.base = sd.shard_rank * sd.units[u].shard_numel;
      // Laid out like the shard: the optimizer's own tensors when one of them
      // is the unit's whole shard, else a copy (use_orig_params).
      if (!other_optimizer_ && background) unit.ostate = s.ShardedOptimizerUnit(params, states, static_cast<int>(u));
      unit.step = other_optimizer_ ? -1 : steps[u];
    }
  }
  if (!other_optimizer_ && !background) {
    ostate_of_ = [&s, params, states](int u) { return s.ShardedOptimizerUnit(params, states, u); };
  }
  if (!other_optimizer_ && !units_.empty()) unit_of_ = UnitOfTensors(s.OptimizedParameterNames(params), sd);
  if (rank_ == 0) {
    for (const auto& [name, b] : sd.buffers) buffers_[name] = b.detach().clone();
    groups_ = groups;
  }
  if (other_optimizer_) archive_ = SerializeOptimizer(opt);
  if (background) {
    for (Unit& unit : units_) {
      ForEachPiece(unit, [&](const ShardPart&, const dcp::Box&, const at::Tensor& piece, const std::string*) {
        unit.crcs.push_back(TensorCrc32(piece));
      });
    }
  }
  file_ = std::make_unique<dcp::RankFileWriter>(ShardedTempDir(path), dcp::RankFileName(rank_));
}

DcpRankWriter::~DcpRankWriter() = default;

int64_t DcpRankWriter::CopyAside(int u) {
  at::NoGradGuard no_grad;
  Unit& unit = units_.at(u);
  int64_t bytes = 0;
  auto copy = [&](at::Tensor& t) {
    if (!t.defined()) return;
    t = t.clone();
    bytes += t.nbytes();
  };
  copy(unit.shard);
  for (auto& [key, t] : unit.ostate) copy(t);
  return bytes;
}

int64_t DcpRankWriter::UnitBytes(int u) const {
  const Unit& unit = units_.at(u);
  int64_t bytes = unit.shard.defined() ? unit.shard.nbytes() : 0;
  for (const auto& [key, t] : unit.ostate) bytes += t.defined() ? t.nbytes() : 0;
  return bytes;
}

void DcpRankWriter::ForEachPiece(const Unit& unit, const PieceFn& fn) const {
  const at::Tensor shard = unit.shard.to(at::kFloat);  // no copy when it is float32
  for (const ShardPart& p : unit.parts) {
    const bool has_state = !unit.ostate.empty() && optimized_.count(p.name);
    for (const dcp::Box& box : dcp::BoxesOfRange(p.shape, p.begin, p.end)) {
      const int64_t src = p.at + dcp::FlatIndex(p.shape, box.offsets) - unit.base;
      for (const BoxPair& pair : GlobalBoxes(p, box)) {  // a tensor-parallel piece: its blocks' boxes
        auto piece = [&](const at::Tensor& flat) {
          at::Tensor t = flat.narrow(0, src, box.numel()).view(box.sizes);
          if (!p.piece) return t;
          const int64_t d = p.piece->dim;
          return t.narrow(d, pair.stored.offsets[d] - box.offsets[d], pair.stored.sizes[d]);
        };
        fn(p, pair.global, piece(shard), nullptr);
        if (!has_state) continue;
        for (const auto& [key, t] : unit.ostate) fn(p, pair.global, piece(t.to(at::kFloat)), &key);
      }
    }
  }
}

void DcpRankWriter::WriteUnit(int u) {
  at::NoGradGuard no_grad;  // grad mode is per thread: the writer's own
  Unit& unit = units_.at(u);
  if (ostate_of_) unit.ostate = ostate_of_(u);
  size_t next = 0;  // copies aside hold the same bytes: the checksums stay right
  ForEachPiece(unit, [&](const ShardPart& p, const dcp::Box& box, const at::Tensor& piece, const std::string* key) {
    const std::optional<uint32_t> crc =
        next < unit.crcs.size() ? std::optional<uint32_t>(unit.crcs[next]) : std::nullopt;
    ++next;
    const dcp::Chunk chunk{box, file_->AddTensor(piece, crc)};
    if (key != nullptr) {
      AddDcpChunk(part_, DcpOptimizerStatePath(p.name, *key), at::kFloat, p.global_shape, chunk);
      return;
    }
    AddDcpChunk(part_, DcpModelPath(p.name), at::kFloat, p.global_shape, chunk);
    for (const auto& [alias, primary] : aliases_) {
      if (primary == p.name) AddDcpChunk(part_, DcpModelPath(alias), at::kFloat, p.global_shape, chunk);  // same bytes
    }
  });
  // Adam's step: a 0-d float32 tensor, as torch.optim keeps it; written by
  // the rank holding the parameter's first element (of the tensor-parallel
  // group's first rank).
  for (const ShardPart& p : unit.parts) {
    const bool has_state = !unit.ostate.empty() && optimized_.count(p.name);
    if (has_state && p.begin == 0 && unit.step >= 0 && writes_whole_) {
      const at::Tensor step = at::full({}, static_cast<double>(unit.step), at::kFloat);
      AddDcpChunk(part_, DcpOptimizerStatePath(p.name, "step"), at::kFloat, {}, {{}, file_->AddTensor(step)});
    }
  }
  unit.shard = at::Tensor();
  unit.ostate.clear();
}

void DcpRankWriter::Finish() {
  for (const auto& [name, b] : buffers_) {
    dcp::Box whole{std::vector<int64_t>(b.dim(), 0), b.sizes().vec()};
    AddDcpChunk(part_, DcpModelPath(name), b.scalar_type(), b.sizes().vec(), {whole, file_->AddTensor(b)});
  }
  if (rank_ == 0) WriteDcpParamGroups(*file_, groups_, part_);
  if (other_optimizer_) {  // another optimizer: its LibTorch archive, per rank
    at::Tensor t = at::empty({static_cast<int64_t>(archive_.size())}, at::kByte);
    if (!archive_.empty()) std::memcpy(t.data_ptr(), archive_.data(), archive_.size());
    AddDcpChunk(part_, DcpArchivePath(rank_), at::kByte, {t.numel()}, {{{0}, {t.numel()}}, file_->AddTensor(t)});
  }
  file_->Finish();
  WriteDcpPart(path_, rank_, part_);
}

void WriteDcpRank(strategies::Strategy& s, torch::optim::Optimizer& opt, const std::string& path,
                  const std::vector<OptimizerGroup>& groups) {
  DcpRankWriter writer(s, opt, path, groups, /*background=*/false);
  for (int u = 0; u < writer.num_units(); ++u) writer.WriteUnit(u);
  writer.Finish();
}

}  // namespace shardtrain::trainer::internal
