// FsdpStrategy ("fsdp", alias "ddp_fully_sharded"): Fully Sharded Data
// Parallel with fairscale FullyShardedDataParallel's options and names, on the
// ShardTrain sharding core.
//
// String options (StrategyRegistry::Create("fsdp", {...})): the table
// FsdpOptions::Table() (fsdp_strategy.cc) gives the keys, the parsing and
// their reference, docs/strategy_options.md. Why min_num_params defaults to 0
// (every Sharded<> wrap point its own unit, as fairscale's wrap() inside
// enable_wrap) rather than Lightning's 1e8: docs/ARCHITECTURE.md, strategies/.
// Only wrap points that are units are checkpointed (activation_checkpointing).
#ifndef SHARDTRAIN_STRATEGIES_FSDP_FSDP_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_FSDP_FSDP_STRATEGY_H_

#include <optional>
#include <string>
#include <vector>

#include "sharding/options.h"
#include "strategies/registry.h"
#include "strategies/sharded_strategy_base.h"

namespace shardtrain::strategies {

struct FsdpOptions {
  // What the core gets as it is: reshard_after_forward sets
  // sharding.sharding_strategy (FULL_SHARD, or SHARD_GRAD_OP for false);
  // fp32_reduce_scatter and gradient_pre/postdivide_factor (0 = default) set
  // the fields of the same names. The table's rows set them here directly.
  // sync_module_states is always true; offload_params and mixed_precision
  // come from the fields below (setting them here is an error).
  sharding::ShardingOptions sharding;
  // What the strategy resolves itself. The dtypes are translated after
  // parsing because they depend on each other (compute_dtype defaults to fp16
  // only with mixed_precision; reduce_dtype follows fp32_reduce_scatter) and
  // on the trainer's precision (FsdpStrategy::PrepareOptions).
  bool flatten_parameters = true;
  bool mixed_precision = false;
  std::optional<c10::ScalarType> compute_dtype;  // default fp16 with mixed_precision
  std::optional<c10::ScalarType> buffer_dtype;   // default compute_dtype
  bool move_grads_to_cpu = false;
  bool cpu_offload = false;
  double bucket_cap_mb = 0;  // only 0: no bucketing across units (the core reduces each unit at once)
  int64_t min_num_params = 0;  // 0: every wrap point is a unit
  // C++ only (fairscale's auto_wrap_policy callable): when set, decides which
  // wrap points become units (module type, parameter count); min_num_params
  // must then stay 0. Give it through TrainerOptions::strategy_object.
  sharding::WrapPolicy auto_wrap_policy_fn;
  bool sharded_construction = true;  // ShardedStrategyBase::set_sharded_construction
  bool state_dict_to_cpu = true;  // only true (false is refused: state dicts are gathered to the host)
  std::vector<std::string> activation_checkpointing;  // module type names

  // The string options: key, values, doc, and which field each sets.
  static const OptionTable<FsdpOptions>& Table();
  static FsdpOptions FromStrings(const StrategyOptions& options, const std::string& strategy_name = "fsdp");
};

class FsdpStrategy : public ShardedStrategyBase {
 public:
  // Throws InvalidArgumentError for invalid values or combinations.
  explicit FsdpStrategy(FsdpOptions options = {}, std::string name = "fsdp");
  std::string name() const override { return name_; }
  const FsdpOptions& options() const { return options_; }

 protected:
  void PrepareOptions(sharding::ShardingOptions& options) const override;

 private:
  FsdpOptions options_;
  std::string name_;
};

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_FSDP_FSDP_STRATEGY_H_
