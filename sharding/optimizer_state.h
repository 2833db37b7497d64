// Optimizer state of a ShardedModel in the forms checkpoints need.
//
// An optimizer over ShardedModel::parameters() steps one tensor per unit (the
// unit's shard, or its trainable prefix) or, with use_orig_params, each
// trainable parameter's part of the shard. Its state tensors (Adam's exp_avg,
// SGD's momentum_buffer, ...) are laid out like those tensors, so a unit's
// state can be laid out like the unit's flat shard and then gathered,
// resharded and consolidated exactly like the parameters. Which state an
// optimizer holds is the caller's business (trainer/connectors/checkpoint_state.cc reads
// and writes LibTorch's optimizers): these functions take and return it as
// OptimizerStates, parallel to the optimized tensors `params` (a subset of
// model.parameters(), in any order). Strategies reach these through the
// Strategy interface (strategies/strategy.h); the trainer never calls them.
#ifndef SHARDTRAIN_SHARDING_OPTIMIZER_STATE_H_
#define SHARDTRAIN_SHARDING_OPTIMIZER_STATE_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "sharding/sharded_state.h"

namespace shardtrain::sharding {

class ShardedModel;

// This rank's optimizer state laid out like its shards, per unit: the state
// itself when one optimized tensor is a unit's whole shard (no copy), else a
// shard-sized float32 copy (zeros where no tensor has the key). Throws
// InvalidArgumentError when a tensor of `params` is not one of
// model.parameters().
std::map<std::string, at::Tensor> UnitOptimizerState(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                                     const OptimizerStates& states, int unit);
// Each unit's step: the largest of its optimized tensors' steps (-1: none).
std::vector<int64_t> UnitOptimizerSteps(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                        const OptimizerStates& states);

// The module parameter names each tensor of `params` holds values of: with
// use_orig_params its parameter's; else its unit's trainable parameters, in
// the unit's order (a rank's shard may hold a part of them only). No
// communication. Throws like UnitOptimizerState.
std::vector<std::vector<std::string>> OptimizedParameterNames(const ShardedModel& model,
                                                              const std::vector<at::Tensor>& params);

// Streams the full (unsharded) optimizer state: for each state key in turn,
// one unit at a time, gathers the unit's state and on world rank `root`
// calls fn(parameter name, key, full tensor; valid during the call), and
// fills `steps` by parameter name on `root`. Collective: every rank calls;
// the ranks first agree on which (unit, key) pairs exist anywhere.
void ForEachFullOptimizerState(ShardedModel& model, const std::vector<at::Tensor>& params,
                               const OptimizerStates& states, int root,
                               const std::function<void(const std::string& name, const std::string& key,
                                                        const at::Tensor& full)>& fn,
                               std::map<std::string, int64_t>* steps);

// This rank's state of each optimized tensor from the full state by parameter
// name (each rank passes the same; sizes are the caller's to check first).
// Parameters of a unit with any state get zeros for keys they lack (never a
// full-size zero tensor). Only this rank's slice of each full tensor is read
// (FlatParameter::ShardOfFull, which hands each source to the active
// SourceReleaseScope).
OptimizerStates OptimizerStatesFromFull(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                        const std::map<std::string, std::map<std::string, at::Tensor>>& state,
                                        const std::map<std::string, int64_t>& step);

// This rank's state of each optimized tensor from each unit's state laid out
// like its shard (`unit_state(u)`, called once per unit, in order).
OptimizerStates OptimizerStatesFromUnits(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                         const std::function<UnitShardState(size_t unit)>& unit_state);

// This rank's state of each optimized tensor from the pieces of a sharded
// checkpoint saved at any world size (`optimizer[i]` is pieces[i]'s state):
// per unit, only the ranges of the saved shards that overlap this rank's
// shards are read, each straight into this rank's state, and each source
// tensor is handed to the active SourceReleaseScope right after its range is
// copied (sharding/source_release.h: a loader drops a mapped record's pages),
// so no more than one source record is resident at a time. The pieces must
// fit the model (ShardedModel::CheckShardedStateDict).
OptimizerStates OptimizerStatesFromShards(const ShardedModel& model, const std::vector<at::Tensor>& params,
                                          const std::vector<ShardedStateDict>& pieces,
                                          const std::vector<ShardedOptimizerState>& optimizer);

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_OPTIMIZER_STATE_H_
