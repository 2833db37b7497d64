// Sharded checkpoint -> full state (trainer/checkpoint_io/sharded_checkpoint.h): every
// unit's shards, in shard-rank order, joined by the sharding core's
// model-free ConsolidateUnit; the optimizer's state likewise.
#include <ATen/ATen.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "base/errors.h"
#include "sharding/sharded_state.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"

namespace shardtrain::trainer {
namespace {

// The piece holding each shard rank (HYBRID_SHARD replicas hold equal shards: the first is used).
std::vector<const ShardedPiece*> ByShardRank(const ShardedCheckpoint& ck) {
  std::vector<const ShardedPiece*> out(ck.pieces.front().state.shard_world, nullptr);
  for (const auto& p : ck.pieces) {
    if (!out[p.state.shard_rank]) out[p.state.shard_rank] = &p;
  }
  return out;
}

}  // namespace

std::map<std::string, at::Tensor> ConsolidateParameters(const ShardedCheckpoint& ck) {
  ST_CHECK_ARG(!ck.pieces.empty(), "sharded checkpoint without pieces");
  auto by = ByShardRank(ck);
  std::map<std::string, at::Tensor> out;
  const auto& first = ck.pieces.front().state;
  for (size_t i = 0; i < first.units.size(); ++i) {
    std::vector<at::Tensor> parts;
    for (const auto* p : by) parts.push_back(p->state.shards[i]);
    out.merge(sharding::ConsolidateUnit(first.units[i], first.param_shapes[i], parts));
  }
  return out;
}

FullOptimizerState ConsolidateOptimizerState(const ShardedCheckpoint& ck) {
  FullOptimizerState out;
  ST_CHECK_ARG(!ck.pieces.empty(), "sharded checkpoint without pieces");
  const auto& first = ck.pieces.front();
  if (first.optimizer_kind.empty() || first.optimizer.units.empty()) return out;
  out.kind = first.optimizer_kind;
  auto by = ByShardRank(ck);
  for (size_t i = 0; i < first.state.units.size(); ++i) {
    const auto& u = first.state.units[i];
    std::set<std::string> keys;
    int64_t step = -1;
    for (const auto* p : by) {
      for (const auto& [k, t] : p->optimizer.units[i]) keys.insert(k);
      step = std::max(step, p->optimizer.steps[i]);
    }
    for (const auto& key : keys) {
      std::vector<at::Tensor> parts;
      for (const auto* p : by) {
        auto it = p->optimizer.units[i].find(key);
        parts.push_back(it != p->optimizer.units[i].end() ? it->second
                                                          : at::zeros({u.shard_numel}, p->state.shards[i].options()));
      }
      for (auto& [name, t] : sharding::ConsolidateUnit(u, first.state.param_shapes[i], parts)) {
        out.state[name][key] = t;
      }
    }
    if (!keys.empty() && step >= 0) {
      for (const auto& name : u.param_names) out.step[name] = step;
    }
  }
  return out;
}

CheckpointData ConsolidateShardedCheckpoint(const ShardedCheckpoint& ck) {
  CheckpointData out = ck.meta;
  out.world_size = static_cast<int64_t>(ck.pieces.size());
  out.state_dict = ConsolidateParameters(ck);
  for (const auto& [k, v] : ck.pieces.front().state.buffers) {
    out.state_dict[k] = at::isFloatingType(v.scalar_type()) ? v.to(at::kFloat) : v.clone();
  }
  out.optimizer_full = ConsolidateOptimizerState(ck);
  if (out.optimizer_groups.empty() && !out.optimizer_full.empty()) {
    // Format 1 did not record the optimizer's groups: one group, in unit order.
    OptimizerGroup& g = out.optimizer_groups.emplace_back();
    for (const auto& u : ck.pieces.front().state.units) {
      for (const auto& n : u.param_names) {
        if (out.optimizer_full.state.count(n)) g.params.push_back(n);
      }
    }
  }
  const bool archives = std::all_of(ck.pieces.begin(), ck.pieces.end(),
                                    [](const ShardedPiece& p) { return !p.optimizer_archive.empty(); });
  if (archives) {
    for (const auto& p : ck.pieces) out.optimizer_states.push_back(p.optimizer_archive);
  }
  return out;
}

}  // namespace shardtrain::trainer
