// ModelParallelStrategy ("model_parallel"): tensor parallelism inside groups
// of tensor_parallel_size ranks and FSDP (FULL_SHARD, on the ShardTrain
// sharding core) across the data_parallel_size groups — Lightning's
// ModelParallelStrategy, torchtitan's 2-D parallelism.
//
// The mesh is data_parallel_size x tensor_parallel_size
// (tensor_parallel/mesh.h: tensor-parallel groups are consecutive ranks, on
// one host when the launcher numbers a host's ranks consecutively). The model
// declares its plan with tensor_parallel/layers.h and must be built while
// MakeConstructionScope() is held (the Trainer holds it around
// configure_model): its tensor-parallel layers then hold only this rank's
// pieces, and the sharding core shards what each rank holds over its
// data-parallel group. Ranks of one tensor-parallel group must be given the
// same batches.
//
// Gradient clipping computes the norm of the global (unsharded) gradients:
// sharded pieces summed over the world, replicated parameters counted once.
// Full state dicts hold every parameter with its global shape and FQN.
#ifndef SHARDTRAIN_STRATEGIES_MODEL_PARALLEL_MODEL_PARALLEL_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_MODEL_PARALLEL_MODEL_PARALLEL_STRATEGY_H_

#include <map>
#include <string>
#include <vector>

#include "strategies/registry.h"
#include "strategies/sharded_strategy_base.h"
#include "tensor_parallel/mesh.h"
#include "tensor_parallel/placement.h"

namespace shardtrain::strategies {

struct ModelParallelOptions {
  int data_parallel_size = 0;    // 0: world size / tensor_parallel_size
  int tensor_parallel_size = 0;  // 0: the ranks of one host (all ranks when data_parallel_size is 0 too)
  bool sequence_parallel = false;
  std::vector<std::string> activation_checkpointing;  // module type names
  bool sharded_construction = true;
  bool save_distributed_checkpoint = false;  // the Trainer's checkpoints sharded (DCP)

  static const OptionTable<ModelParallelOptions>& Table();
  static ModelParallelOptions FromStrings(const StrategyOptions& options);
};

class ModelParallelStrategy : public ShardedStrategyBase {
 public:
  explicit ModelParallelStrategy(ModelParallelOptions options = {});
  std::string name() const override { return "model_parallel"; }
  // Builds the mesh (collective: every rank creates every group).
  void Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) override;
  std::unique_ptr<ConstructionScope> MakeConstructionScope() override;
  bool prefers_sharded_checkpoint() const override { return options_.save_distributed_checkpoint; }
  void WrapModel(std::shared_ptr<torch::nn::Module> module) override;
  void Backward(const at::Tensor& loss, bool sync_gradients = true) override;
  at::Tensor ClipGradNormOnDevice(double max_norm, double norm_type = 2.0) override;
  std::map<std::string, at::Tensor> FullStateDict() override;
  void LoadFullStateDict(const std::map<std::string, at::Tensor>& state) override;
  void ForEachFullStateTensor(int root, const FullStateSink& sink) override;
  // The optimizer state of full checkpoints, at global shapes by FQN (a
  // checkpoint resumes at another mesh or with another strategy).
  void ForEachFullOptimizerState(const std::vector<at::Tensor>& params, const sharding::OptimizerStates& states,
                                 int root, const FullOptimizerStateFn& fn,
                                 std::map<std::string, int64_t>* steps) override;
  sharding::OptimizerStates OptimizerStatesFromFull(
      const std::vector<at::Tensor>& params, const std::map<std::string, std::map<std::string, at::Tensor>>& state,
      const std::map<std::string, int64_t>& step) override;
  // The sharding core's state dict with each tensor-parallel parameter's
  // place in its global tensor (sharded DCP checkpoints hold every tensor at
  // its global shape; the first rank of each tensor-parallel group writes
  // the replicated parameters).
  sharding::ShardedStateDict ShardedState() const override;
  // Global shapes.
  std::map<std::string, std::vector<int64_t>> ParameterShapes() const override;
  // The sharding core's rows with the units' global parameter counts (the
  // stored elements stay this rank's).
  std::vector<UnitSummary> UnitSummaries() const override;

  int data_parallel_rank() const override { return set_up_ ? mesh_.dp_rank : rank(); }
  int data_parallel_size() const override { return set_up_ ? mesh_.dp_size : world_size(); }
  const tensor_parallel::DeviceMesh& mesh() const { return mesh_; }
  const ModelParallelOptions& options() const { return options_; }
  // Every parameter's placement on the tensor-parallel group, by FQN (after WrapModel).
  const std::map<std::string, tensor_parallel::Placement>& placements() const { return placements_; }

 protected:
  comm::CommunicatorPtr ShardingWorld() const override { return mesh_.dp; }
  void PrepareOptions(sharding::ShardingOptions& options) const override;

 private:
  void CheckPlacements() const;
  // Sums the partial gradients (sequence-parallel parameters) over the
  // tensor-parallel group.
  void ReducePartialGradients();
  // The placement of `name` when it is sharded and `t` is shaped like it.
  const tensor_parallel::Placement* ShardedPlacement(const std::string& name, const at::Tensor& t) const;

  ModelParallelOptions options_;
  tensor_parallel::DeviceMesh mesh_;
  std::map<std::string, tensor_parallel::Placement> placements_;
};

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_MODEL_PARALLEL_MODEL_PARALLEL_STRATEGY_H_
