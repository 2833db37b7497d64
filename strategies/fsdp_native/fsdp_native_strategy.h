// FsdpNativeStrategy ("fsdp_native", "fsdp_native_full_shard_offload"):
// Fully Sharded Data Parallel with PyTorch torch.distributed.fsdp's options and
// names, on the ShardTrain sharding core.
//
// String options (StrategyRegistry::Create("fsdp_native", {...})):
//   sharding_strategy      FULL_SHARD (default) | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD
//   hybrid_shard_group_size  ranks per shard group for HYBRID_SHARD (default: ranks per node)
//   cpu_offload / offload_params  true|false (CPUOffload(offload_params=...); the
//                          fsdp_native_full_shard_offload name sets it). With the Trainer's
//                          accelerator cuda: ShardingOptions::offload_params (shards, gradients
//                          and the optimizer step in pinned host memory). On CPU the parameters
//                          already live in host memory: it stays off and WrapModel says so once
//                          (rank 0).
//   auto_wrap_policy       always (default) | never | size:N (size_based_auto_wrap_policy,
//                          min_num_params=N) | type:BlockImpl,OtherImpl (transformer_auto_wrap_policy)
//   backward_prefetch      BACKWARD_PRE (default) | BACKWARD_POST | NONE
//   forward_prefetch       true|false (default false)
//   limit_all_gathers      true|false (default true: at most 2 units unsharded through prefetch)
//   mixed_precision        shorthand: bf16|fp16|fp32 sets param, reduce and buffer dtype
//   param_dtype, reduce_dtype, buffer_dtype  bf16|fp16|fp32 (MixedPrecision fields)
//   sync_module_states     true|false (default true; PyTorch defaults to false, but
//                          ranks that start different would silently train different replicas)
//   use_orig_params        true|false (default false)
//   activation_checkpointing_policy  type:BlockImpl,OtherImpl (default none): units whose
//                          module type is listed recompute their forward in backward
//   activation_checkpointing  BlockImpl,OtherImpl (Lightning's spelling: a list of module
//                          types); give it or activation_checkpointing_policy, not both.
//                          Type names match as in auto_wrap_policy=type: (the full name,
//                          or its trailing part after "::", e.g. "gpt::BlockImpl")
//   state_dict_type        full (default) | sharded. (LOCAL is not supported.)
#ifndef SHARDTRAIN_STRATEGIES_FSDP_NATIVE_FSDP_NATIVE_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_FSDP_NATIVE_FSDP_NATIVE_STRATEGY_H_

#include <optional>
#include <string>
#include <vector>

#include "sharding/options.h"
#include "strategies/registry.h"
#include "strategies/sharded_strategy_base.h"

namespace shardtrain::strategies {

struct FsdpNativeOptions {
  sharding::ShardingStrategy sharding_strategy = sharding::ShardingStrategy::kFullShard;
  int hybrid_shard_group_size = 0;
  bool cpu_offload = false;  // CPUOffload(offload_params=...)
  std::string auto_wrap_policy = "always";
  sharding::BackwardPrefetch backward_prefetch = sharding::BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  bool limit_all_gathers = true;
  // Unset fields: float32, or what the trainer's precision implies when no
  // field is set at all.
  sharding::MixedPrecision mixed_precision;
  bool sync_module_states = true;
  bool use_orig_params = false;
  std::string activation_checkpointing_policy;  // "" or "type:A,B"
  std::vector<std::string> activation_checkpointing;  // module type names (Lightning's list)
  std::string state_dict_type = "full";         // "full" or "sharded"

  // Parses string options (keys as in the header comment).
  static FsdpNativeOptions FromStrings(const StrategyOptions& options, const std::string& strategy_name = "fsdp_native");
  static std::vector<std::string> ValidKeys();
};

class FsdpNativeStrategy : public ShardedStrategyBase {
 public:
  // Throws InvalidArgumentError for invalid values or combinations.
  explicit FsdpNativeStrategy(FsdpNativeOptions options = {}, std::string name = "fsdp_native");
  std::string name() const override { return name_; }
  void Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) override;
  bool prefers_sharded_checkpoint() const override { return options_.state_dict_type == "sharded"; }
  const FsdpNativeOptions& options() const { return options_; }

 protected:
  void PrepareOptions(sharding::ShardingOptions& options) const override;

 private:
  FsdpNativeOptions options_;
  std::string name_;
};

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_FSDP_NATIVE_FSDP_NATIVE_STRATEGY_H_
