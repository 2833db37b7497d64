// Model-free arithmetic over sharded state (sharding/sharded_state.h).
#include "sharding/sharded_state.h"

#include <ATen/ATen.h>

#include <sstream>

#include "base/errors.h"

namespace shardtrain::sharding {

std::vector<size_t> PieceOfShardRank(const std::vector<ShardedStateDict>& pieces) {
  ST_CHECK_ARG(!pieces.empty(), "LoadShardedStateDict: no pieces given");
  const int old_world = pieces.front().shard_world;
  constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<size_t> by_rank(old_world, kNone);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& p = pieces[i];
    ST_CHECK_ARG(p.shard_world == old_world, "sharded checkpoint pieces disagree on the world size (", old_world,
                 " vs ", p.shard_world, ")");
    ST_CHECK_ARG(p.shard_rank >= 0 && p.shard_rank < old_world, "sharded checkpoint piece has rank ", p.shard_rank,
                 " outside [0, ", old_world, ")");
    if (by_rank[p.shard_rank] == kNone) by_rank[p.shard_rank] = i;
  }
  for (int r = 0; r < old_world; ++r) {
    ST_CHECK_ARG(by_rank[r] != kNone, "sharded checkpoint is missing the shard of rank ", r, " (of ", old_world, ")");
  }
  return by_rank;
}

std::vector<FlatUnitLayout> SavedLayouts(const std::vector<ShardedStateDict>& pieces,
                                         const std::vector<size_t>& by_shard_rank,
                                         const std::map<std::string, int64_t>& fallback_numel,
                                         std::vector<std::string>* problems) {
  const ShardedStateDict& first = pieces.front();
  const auto& meta = first.units;
  const int64_t old_world = static_cast<int64_t>(by_shard_rank.size());
  ST_CHECK_ARG(first.param_shapes.empty() || first.param_shapes.size() == meta.size(),
               "sharded checkpoint: parameter shapes for ", first.param_shapes.size(), " units, expected ", meta.size());
  std::vector<FlatUnitLayout> src;
  for (size_t i = 0; i < meta.size(); ++i) {
    FlatUnitLayout l{meta[i].name, meta[i].param_names, {}, meta[i].shard_numel};
    for (size_t k = 0; k < meta[i].param_names.size(); ++k) {
      int64_t n = 0;
      if (!first.param_shapes.empty() && k < first.param_shapes[i].size()) {
        n = c10::multiply_integers(first.param_shapes[i][k]);
      } else {
        auto it = fallback_numel.find(meta[i].param_names[k]);
        n = it == fallback_numel.end() ? 0 : it->second;
      }
      l.param_numels.push_back(n);
    }
    if (l.numel() != meta[i].numel || meta[i].shard_numel * old_world < meta[i].numel) {
      std::ostringstream line;
      line << "unit '" << meta[i].name << "' has " << meta[i].numel << " elements in " << old_world << " shards of "
           << meta[i].shard_numel << ", its parameters " << l.numel();
      problems->push_back(line.str());
    }
    for (int64_t r = 0; r < old_world; ++r) {
      const ShardedStateDict& p = pieces[by_shard_rank[r]];
      if (p.shards.size() != meta.size() || p.shards[i].numel() != meta[i].shard_numel) {
        std::ostringstream line;
        line << "the piece of shard rank " << r << " does not hold unit '" << meta[i].name << "' ("
             << meta[i].shard_numel << " elements)";
        problems->push_back(line.str());
      }
    }
    src.push_back(std::move(l));
  }
  return src;
}

std::map<std::string, at::Tensor> ConsolidateUnit(const UnitInfo& unit,
                                                  const std::vector<std::vector<int64_t>>& shapes,
                                                  const std::vector<at::Tensor>& shards_by_rank) {
  ST_CHECK_ARG(shapes.size() == unit.param_names.size(), "unit '", unit.name, "': ", shapes.size(),
               " parameter shapes for ", unit.param_names.size(), " parameters");
  std::vector<at::Tensor> parts;
  for (const auto& s : shards_by_rank) parts.push_back(s.reshape({-1}).to(at::kFloat));
  const at::Tensor flat = at::cat(parts).narrow(0, 0, unit.numel);
  std::map<std::string, at::Tensor> out;
  int64_t offset = 0;
  for (size_t k = 0; k < unit.param_names.size(); ++k) {
    const int64_t n = c10::multiply_integers(shapes[k]);
    out[unit.param_names[k]] = flat.narrow(0, offset, n).reshape(shapes[k]).clone();
    offset += n;
  }
  return out;
}

}  // namespace shardtrain::sharding
