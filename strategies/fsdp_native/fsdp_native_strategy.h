// FsdpNativeStrategy ("fsdp_native", "fsdp_native_full_shard_offload"):
// Fully Sharded Data Parallel with PyTorch torch.distributed.fsdp's options and
// names, on the ShardTrain sharding core.
//
// String options (StrategyRegistry::Create("fsdp_native", {...})): the table
// FsdpNativeOptions::Table() (fsdp_native_strategy.cc) gives the keys, the
// parsing and their reference, docs/strategy_options.md. Type names (in
// auto_wrap_policy=type:, activation_checkpointing) match the full name or its
// trailing part after "::" (e.g. "gpt::BlockImpl").
#ifndef SHARDTRAIN_STRATEGIES_FSDP_NATIVE_FSDP_NATIVE_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_FSDP_NATIVE_FSDP_NATIVE_STRATEGY_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "sharding/options.h"
#include "strategies/registry.h"
#include "strategies/sharded_strategy_base.h"

namespace shardtrain::strategies {

struct FsdpNativeOptions {
  // What the core gets: sharding_strategy, hybrid_shard_group_size,
  // backward_prefetch, forward_prefetch, limit_all_gathers, mixed_precision,
  // sync_module_states, use_orig_params are PyTorch's options under the same
  // names, so the table's rows set them here directly. Unset mixed_precision
  // fields: float32, or what the trainer's precision implies when no field
  // is set at all. offload_params comes from cpu_offload (setting it here is
  // an error).
  sharding::ShardingOptions sharding;
  // What the strategy resolves itself: offload (CUDA only), the wrap and
  // activation-checkpointing policies, the checkpoint format.
  bool cpu_offload = false;  // CPUOffload(offload_params=...)
  std::string auto_wrap_policy = "always";
  // C++ only (PyTorch's callable auto_wrap_policy): when set, decides which
  // wrap points become units from the wrap point (its module type, or a
  // dynamic_cast to it) and its parameter count; auto_wrap_policy must then
  // stay "always". Give it through TrainerOptions::strategy_object.
  sharding::WrapPolicy auto_wrap_policy_fn;
  std::string activation_checkpointing_policy;  // "" or "type:A,B"
  std::vector<std::string> activation_checkpointing;  // module type names (Lightning's list)
  std::string state_dict_type = "full";         // "full" or "sharded"
  bool sharded_construction = true;  // ShardedStrategyBase::set_sharded_construction

  // The string options: key, values, doc, and which field each sets.
  static const OptionTable<FsdpNativeOptions>& Table();
  static FsdpNativeOptions FromStrings(const StrategyOptions& options, const std::string& strategy_name = "fsdp_native");
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
