// Parsing and naming of the sharding core's option enums (sharding/options.h).
#include "sharding/options.h"

#include <cctype>

#include "base/errors.h"

namespace shardtrain::sharding {

const char* ShardingStrategyName(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "?";
}

static std::string Upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

ShardingStrategy ParseShardingStrategy(const std::string& name) {
  const std::string u = Upper(name);
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                 ShardingStrategy::kHybridShard}) {
    if (u == ShardingStrategyName(s)) return s;
  }
  ST_THROW(InvalidArgumentError, "unknown sharding_strategy '", name,
           "'; valid: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD");
}

const char* BackwardPrefetchName(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::kNone: return "NONE";
    case BackwardPrefetch::kBackwardPre: return "BACKWARD_PRE";
    case BackwardPrefetch::kBackwardPost: return "BACKWARD_POST";
  }
  return "?";
}

BackwardPrefetch ParseBackwardPrefetch(const std::string& name) {
  const std::string u = Upper(name);
  for (auto p : {BackwardPrefetch::kNone, BackwardPrefetch::kBackwardPre, BackwardPrefetch::kBackwardPost}) {
    if (u == BackwardPrefetchName(p)) return p;
  }
  ST_THROW(InvalidArgumentError, "unknown backward_prefetch '", name, "'; valid: BACKWARD_PRE, BACKWARD_POST, NONE");
}

}  // namespace shardtrain::sharding
