// ShardedStrategyBase: what the two FSDP strategies (fsdp, fsdp_native) share —
// running a sharding::ShardedModel. Each strategy translates its own option
// vocabulary into sharding::ShardingOptions + a WrapPolicy and derives from
// this class; the two never see each other. Not for direct use.
#ifndef SHARDTRAIN_STRATEGIES_SHARDED_STRATEGY_BASE_H_
#define SHARDTRAIN_STRATEGIES_SHARDED_STRATEGY_BASE_H_

#include <functional>
#include <memory>

#include "sharding/options.h"
#include "sharding/sharded_model.h"
#include "strategies/option_table.h"
#include "strategies/strategy.h"

namespace shardtrain::strategies {

class ShardedStrategyBase : public Strategy {
 public:
  ~ShardedStrategyBase() override;

  // Rejects "bf16-true": Lightning's *-true keeps the parameters themselves
  // (and the optimizer state) in that dtype, while the sharding core always
  // keeps float32 master shards; the message points to "bf16-mixed".
  void SetPrecision(const std::string& precision) override;
  void WrapModel(std::shared_ptr<torch::nn::Module> module) override;
  // Sharded construction (the option sharded_construction): when on,
  // MakeConstructionScope returns a sharding::ShardedInitScope for the shard
  // group and wrap policy WrapModel will use, so each Sharded<> wrap point
  // keeps only this rank's shard as soon as it is built and no rank holds the
  // whole model (sharding/sharded_init.h). A configure_model that reads or
  // initialises wrapped parameters after constructing them (instead of in the
  // wrapped module's constructor) then gets an exception naming them. On a
  // GPU the model is still built on the CPU and reaches the device shard by
  // shard (sharding::ShardedInitScope::MoveToDevice). Not for NO_SHARD at
  // W > 1: MakeConstructionScope then returns nullptr and the model is built
  // whole.
  void set_sharded_construction(bool on) override { sharded_construction_ = on; }
  bool sharded_construction() const override { return sharded_construction_; }
  std::unique_ptr<ConstructionScope> MakeConstructionScope() override;
  c10::ScalarType compute_dtype() const override;
  at::Tensor Forward(const std::function<at::Tensor()>& fn) override;
  std::vector<at::Tensor> parameters() const override;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const override;
  void Backward(const at::Tensor& loss, bool sync_gradients = true) override;
  double ClipGradNorm(double max_norm, double norm_type = 2.0) override;
  at::Tensor ClipGradNormOnDevice(double max_norm, double norm_type = 2.0) override;
  std::map<std::string, at::Tensor> FullStateDict() override;
  void LoadFullStateDict(const std::map<std::string, at::Tensor>& state) override;

  // Checkpoint state (strategies/strategy.h), through the sharding core
  // (sharding/sharded_model.h, sharding/optimizer_state.h).
  void ForEachFullStateTensor(int root, const FullStateSink& sink) override;
  void ForEachFullOptimizerState(const std::vector<at::Tensor>& params, const sharding::OptimizerStates& states,
                                 int root, const FullOptimizerStateFn& fn,
                                 std::map<std::string, int64_t>* steps) override;
  sharding::OptimizerStates OptimizerStatesFromFull(
      const std::vector<at::Tensor>& params, const std::map<std::string, std::map<std::string, at::Tensor>>& state,
      const std::map<std::string, int64_t>& step) override;
  std::vector<std::vector<std::string>> OptimizedParameterNames(const std::vector<at::Tensor>& params) const override;
  bool has_sharded_state() const override { return sm_ != nullptr; }
  // One row per unit of the sharding core: this rank's float32 shard.
  std::vector<UnitSummary> UnitSummaries() const override;
  sharding::ShardedStateDict ShardedState() const override;
  std::vector<int64_t> ShardedOptimizerSteps(const std::vector<at::Tensor>& params,
                                             const sharding::OptimizerStates& states) const override;
  std::map<std::string, at::Tensor> ShardedOptimizerUnit(const std::vector<at::Tensor>& params,
                                                         const sharding::OptimizerStates& states,
                                                         int unit) const override;
  std::vector<std::string> CheckShardedState(const std::vector<sharding::ShardedStateDict>& pieces) const override;
  void LoadShardedState(const std::vector<sharding::ShardedStateDict>& pieces) override;
  sharding::OptimizerStates OptimizerStatesFromShards(
      const std::vector<at::Tensor>& params, const std::vector<sharding::ShardedStateDict>& pieces,
      const std::vector<sharding::ShardedOptimizerState>& optimizer) const override;
  void LoadShardsWith(const std::function<void(size_t unit, at::Tensor& shard)>& fill,
                      const std::map<std::string, at::Tensor>& buffers) override;
  sharding::OptimizerStates OptimizerStatesFromUnits(
      const std::vector<at::Tensor>& params,
      const std::function<sharding::UnitShardState(size_t unit)>& unit_state) const override;

  // The sharding core, for tests and benchmarks that inspect it (units,
  // communication times). The Trainer does not use it.
  sharding::ShardedModel& sharded_model();
  // The options handed to the sharding core: before WrapModel what the
  // strategy's own options set, after it what the core got (precision and
  // device applied).
  const sharding::ShardingOptions& sharding_options() const { return sharding_options_; }
  // What WrapModel would hand to the sharding core now, given the precision
  // and device set so far (nothing is built; for inspection and tests).
  sharding::ShardingOptions ResolvedShardingOptions() const;

 protected:
  ShardedStrategyBase() = default;
  // Called by WrapModel (and ResolvedShardingOptions) before the ShardedModel
  // is built: the strategy adjusts the options to the precision. No side effects.
  virtual void PrepareOptions(sharding::ShardingOptions& options) const {}
  // The group the sharding core shards over: the world, or for a strategy
  // with more mesh dimensions (model_parallel) its data-parallel group.
  virtual comm::CommunicatorPtr ShardingWorld() const { return world_; }
  // Mixed precision implied by the trainer's precision (for strategies whose
  // own mixed precision option was not given).
  static sharding::MixedPrecision PrecisionToMixed(Precision precision);

  sharding::ShardingOptions sharding_options_;
  sharding::WrapPolicy policy_ = sharding::WrapPolicy::Always();
  std::function<bool(const sharding::WrapPoint&)> checkpoint_;
  // Set by a strategy whose options ask for CPU offload: the spelling the user
  // gave (e.g. "cpu_offload"), "" when not asked. With a CUDA device() it
  // becomes ShardingOptions::offload_params; on CPU the parameters already
  // live in host memory, so it stays off and WrapModel says so (rank 0).
  std::string offload_requested_by_;
  std::unique_ptr<sharding::ShardedModel> sm_;
  bool sharded_construction_ = true;
};

// Parses a comma-separated list of module type names ("BlockImpl,MlpImpl").
std::vector<std::string> SplitTypeNames(const std::string& list);
// Throws InvalidArgumentError when `types` (option `key`'s value) is empty.
void CheckTypeList(const std::string& strategy, const std::string& key, const std::vector<std::string>& types);

// An option row for a list of module type names ("BlockImpl,MlpImpl"), at least one.
template <typename O>
OptionRow<O> OptionTypeList(std::string key, std::vector<std::string> O::*field, std::string doc) {
  return {{std::move(key), "TypeA,TypeB", std::move(doc)},
          [field](O& o, const std::string& s, const std::string& k, const std::string& v) {
            o.*field = SplitTypeNames(v);
            CheckTypeList(s, k, o.*field);
          }};
}

// The sharded_construction row both FSDP strategies offer (set_sharded_construction).
template <typename O>
OptionRow<O> OptionShardedConstruction(bool O::*field) {
  return OptionBool("sharded_construction", field,
                    "build each Sharded<> wrap point straight into this rank's shard while the Trainer runs "
                    "configure_model (on the CPU; with a GPU the shards then move to it one wrap point at a time; "
                    "Lightning's init_module(empty_init=True)): no rank holds the whole model, in host or GPU memory; "
                    "a wrapped parameter read or written before the model is wrapped throws naming it (default true)");
}

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_SHARDED_STRATEGY_BASE_H_
