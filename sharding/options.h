// Options of the FSDP core, in PyTorch FSDP's vocabulary. Strategies translate
// their own option sets (fairscale-style, PyTorch-style) into these.
#ifndef SHARDTRAIN_SHARDING_OPTIONS_H_
#define SHARDTRAIN_SHARDING_OPTIONS_H_

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <utility>

namespace shardtrain::sharding {

// How parameters, gradients and optimizer state are split.
enum class ShardingStrategy {
  kFullShard,     // shard everything; free full parameters after forward and after backward
  kShardGradOp,   // shard grads/optimizer state; keep full parameters from forward until after backward
  kNoShard,       // replicate (DDP-like): all-reduce gradients
  kHybridShard,   // FULL_SHARD within a shard group, replicate across groups
};
const char* ShardingStrategyName(ShardingStrategy s);
// Parses "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD" (case-insensitive).
// Throws InvalidArgumentError listing the valid names.
ShardingStrategy ParseShardingStrategy(const std::string& name);

// When backward fetches the next unit's full parameters.
enum class BackwardPrefetch {
  kNone,
  kBackwardPre,   // issue the next unit's all-gather before computing this unit's gradients
  kBackwardPost,  // issue it after this unit's gradients are computed, before reduce-scatter
};
const char* BackwardPrefetchName(BackwardPrefetch p);
BackwardPrefetch ParseBackwardPrefetch(const std::string& name);

// Low-precision copies for compute (param_dtype), gradient reduction
// (reduce_dtype) and buffers (buffer_dtype). Unset means float32 (no cast).
// Master shards and optimizer state always stay float32.
struct MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<c10::ScalarType> buffer_dtype;
};

struct ShardingOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  // Size of the shard group for HYBRID_SHARD; 0 = ranks per node (or the world
  // size when that is unknown). Must divide the world size.
  int hybrid_shard_group_size = 0;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  // At most this many units hold full parameters at once through prefetching
  // (the unit computing plus prefetched ones); 0 = unlimited. PyTorch's
  // limit_all_gathers=True corresponds to 2.
  int limit_all_gathers = 2;
  MixedPrecision mixed_precision;
  // Reduce gradients in float32 even when param_dtype is lower (fairscale's
  // fp32_reduce_scatter).
  bool fp32_reduce_scatter = false;
  // Gradients are divided by pre_divide before and post_divide after the
  // reduction; 0 = PyTorch's default split of the world size
  // (a factor near sqrt(W) before, the rest after).
  double gradient_predivide_factor = 0;
  double gradient_postdivide_factor = 0;
  // Broadcast rank 0's parameters and buffers to all ranks at setup.
  bool sync_module_states = true;
  // Expose per-parameter shard views (use_orig_params) for optimizer groups.
  bool use_orig_params = false;
  // CPU offload (PyTorch's CPUOffload(offload_params=True)): with CUDA compute,
  // shards, their gradients and so the optimizer step live in pinned CPU
  // memory; each gather copies the shard to the GPU (asynchronously) first and
  // each reduced gradient comes back to the CPU. With CPU compute it changes nothing.
  bool offload_params = false;
  // Testing and diagnosis: run each unit's all-gather even where one rank
  // holds the whole shard (a shard group of 1, e.g. W=1), instead of using
  // the shard in place. Results are the same (the gather of one shard is a
  // copy); what changes is that the collective path — its stream ordering on
  // CUDA, its events and waits — runs on a one-GPU machine.
  bool force_collectives = false;
};

// What the sharding core derives from ShardingOptions, in one place.
//
// Checks the values that do not depend on the world: limit_all_gathers >= 0
// and mixed-precision dtypes among float32, bfloat16, float16. Throws
// InvalidArgumentError naming the option and its valid values.
void ValidateShardingOptions(const ShardingOptions& options);
// The dtypes the core computes, reduces and keeps buffers in: float32,
// bfloat16, float16 (or unset). Throws InvalidArgumentError naming `what`
// (e.g. "strategy 'fsdp': compute_dtype") and the valid dtypes otherwise.
void CheckMixedPrecisionDtype(const std::string& what, const std::optional<c10::ScalarType>& dtype);
// The dtype the model computes in (mixed_precision.param_dtype or float32).
c10::ScalarType ParamDtype(const ShardingOptions& options);
// The dtype gradients are reduced in (float32 with fp32_reduce_scatter, else
// mixed_precision.reduce_dtype, else the param dtype).
c10::ScalarType ReduceDtype(const ShardingOptions& options);
// HYBRID_SHARD's shard group size: hybrid_shard_group_size, else
// `local_world_size` when known (> 0), else the world size. Throws when it
// does not divide `world_size`, saying what to set.
int HybridShardGroupSize(const ShardingOptions& options, int world_size, int local_world_size);
// Gradients are divided by .first before and .second after the sum over the
// world (PyTorch's split of the world size unless the options set them).
std::pair<double, double> GradientDivideFactors(const ShardingOptions& options, int world_size);

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_OPTIONS_H_
