// Parsing and naming of the sharding core's option enums, and what the core
// derives from the options (sharding/options.h).
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

void ValidateShardingOptions(const ShardingOptions& options) {
  ST_CHECK_ARG(options.limit_all_gathers >= 0, "limit_all_gathers must be >= 0 (0 = unlimited), got ",
               options.limit_all_gathers);
  CheckMixedPrecisionDtype("mixed_precision.param_dtype", options.mixed_precision.param_dtype);
  CheckMixedPrecisionDtype("mixed_precision.reduce_dtype", options.mixed_precision.reduce_dtype);
  CheckMixedPrecisionDtype("mixed_precision.buffer_dtype", options.mixed_precision.buffer_dtype);
}

void CheckMixedPrecisionDtype(const std::string& what, const std::optional<c10::ScalarType>& dtype) {
  ST_CHECK_ARG(!dtype || *dtype == c10::kFloat || *dtype == c10::kBFloat16 || *dtype == c10::kHalf, what,
               " must be bf16, fp16 or fp32, got ", c10::toString(*dtype));
}

c10::ScalarType ParamDtype(const ShardingOptions& options) {
  return options.mixed_precision.param_dtype.value_or(c10::kFloat);
}

c10::ScalarType ReduceDtype(const ShardingOptions& options) {
  return options.fp32_reduce_scatter ? c10::kFloat : options.mixed_precision.reduce_dtype.value_or(ParamDtype(options));
}

int HybridShardGroupSize(const ShardingOptions& options, int world_size, int local_world_size) {
  const int s = options.hybrid_shard_group_size > 0 ? options.hybrid_shard_group_size
                : local_world_size > 0              ? local_world_size
                                                    : world_size;
  ST_CHECK_ARG(s > 0 && world_size % s == 0, "HYBRID_SHARD: shard group size ", s, " does not divide the world size ",
               world_size, "; set hybrid_shard_group_size to a divisor of ", world_size);
  return s;
}

std::pair<double, double> GradientDivideFactors(const ShardingOptions& options, int world_size) {
  if (options.gradient_predivide_factor > 0 || options.gradient_postdivide_factor > 0) {
    const double pre = options.gradient_predivide_factor > 0 ? options.gradient_predivide_factor : 1.0;
    const double post =
        options.gradient_postdivide_factor > 0 ? options.gradient_postdivide_factor : world_size / pre;
    return {pre, post};
  }
  int factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return {static_cast<double>(factor), static_cast<double>(world_size) / factor};
}

}  // namespace shardtrain::sharding
