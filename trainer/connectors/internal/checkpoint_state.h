// Internal to //trainer: moving model and optimizer state between a strategy
// and checkpoint structures (trainer/checkpoint_io/checkpoint.h, trainer/checkpoint_io/sharded_checkpoint.h).
//
// Optimizer state is handled generically for Adam, AdamW and SGD: per
// optimized tensor, the state tensors shaped like it (exp_avg, exp_avg_sq,
// max_exp_avg_sq, momentum_buffer) and Adam's step, handed to the strategy
// (strategies/strategy.h, "Checkpoint state"), which gathers, shards and
// reshards it (for sharded strategies it is laid out like the units' flat
// parameters). Other optimizers are saved as their LibTorch archive (same
// world size only).
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_STATE_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_STATE_H_

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "strategies/strategy.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer::internal {

// The optimizer's tensors, in its groups' order; the state of each (no
// copies); installing one tensor's state (nullopt: none) for `kind`.
std::vector<at::Tensor> OptimizerParams(const torch::optim::Optimizer& opt);
sharding::OptimizerStates StatesOf(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params);
void SetState(torch::optim::Optimizer& opt, const std::string& kind, const at::Tensor& p,
              const std::optional<sharding::OptimizerTensorState>& st);
// Global parameter shapes by name (the module keeps them while sharded;
// a tied weight under each of its names; Strategy::ParameterShapes).
std::map<std::string, std::vector<int64_t>> ParamShapes(strategies::Strategy& s);
// The shapes of the tensors this rank stores by name: ParamShapes, but a
// tensor-parallel piece's own shape.
std::map<std::string, std::vector<int64_t>> StoredShapes(strategies::Strategy& s);
// The further names of tied weights: alias -> its name in the units of `sd`.
std::map<std::string, std::string> TiedAliases(strategies::Strategy& s, const sharding::ShardedStateDict& sd);

// "Adam", "AdamW", "SGD", or "" for optimizers without reshardable state support.
std::string OptimizerKind(const torch::optim::Optimizer& opt);
// The LibTorch archive of the optimizer (state and parameter groups).
std::string SerializeOptimizer(const torch::optim::Optimizer& opt);
// Loads an archive; throws shardtrain::Error naming `path` when it does not fit.
void LoadOptimizerArchive(torch::optim::Optimizer& opt, const std::string& bytes, const std::string& path);

// The "state_dict" entry and the optimizer state by name of a full
// checkpoint, their tensors already written to the archive (placeholders), on
// rank 0; None / empty elsewhere. `error` is rank 0's first write error ("" when none).
struct StreamedState {
  c10::IValue state_dict;
  FullOptimizerState optimizer_full;  // empty for optimizers other than Adam, AdamW, SGD
  std::string error;
};

// The optimizer's parameter groups: each group's parameter names (in the
// module's parameter order; the same on every rank: the ranks' views are
// summed through `all_reduce_sum`, a collective every rank calls) and its
// options as torch.optim writes them.
std::vector<OptimizerGroup> OptimizerGroups(
    strategies::Strategy& strategy, const torch::optim::Optimizer& opt,
    const std::function<std::vector<double>(std::vector<double>)>& all_reduce_sum);

// The options of the file's groups that the Trainer restores: each group's
// "lr", and "momentum" or "betas"[0] (empty unless every group has one).
// Both empty when a group lacks "lr".
struct LoadedGroupLrs {
  std::vector<double> lrs, momentums;
};
LoadedGroupLrs GroupLrsAndMomentums(const std::vector<OptimizerGroup>& groups);

// Writes the full (unsharded) model state and optimizer state by name into
// `writer` (rank 0's; nullptr on other ranks), one tensor at a time: sharded
// strategies gather one unit at a time (Strategy::ForEachFullStateTensor),
// each full tensor is written and dropped before the next unit is gathered.
// Collective for sharded strategies. A write error on rank 0 stops its
// writing but not its part in the collectives (returned in `error`).
StreamedState StreamFullState(strategies::Strategy& strategy, torch::optim::Optimizer& opt, ArchiveWriter* writer);

// Loading a sharded checkpoint into a sharded strategy at any world size
// without building the full model: checks the saved layout against the
// model (names and sizes; the error lists every problem), computes this
// rank's optimizer state from only the ranges of the (mapped) source shards
// that overlap this rank's shards, and returns the function that installs
// parameters, buffers and optimizer state. Under a SourceReleaseScope
// (the Trainer holds one) each source record is released as soon as its
// range is copied. Throws shardtrain::Error naming
// `path`, with nothing changed, when the checkpoint does not fit.
std::function<void()> PrepareShardedLoad(strategies::Strategy& strategy, torch::optim::Optimizer& opt,
                                         const ShardedCheckpoint& ckpt, const std::string& path);

// Sharded checkpoints in PyTorch DCP's layout (trainer/checkpoint_io/
// dcp_checkpoint.h). WriteDcpRank writes this rank's file and its part of
// the metadata into the temporary directory of `path` (no communication):
// the boxes its shards cover of each parameter and, for Adam, AdamW and
// SGD, of each optimizer state tensor (other optimizers: their LibTorch
// archive); rank 0 also the buffers and `groups`. PrepareDcpLoad is
// PrepareShardedLoad for such a checkpoint: every problem is found before
// anything changes, and each rank reads only the chunks' runs that overlap
// its shards.
void WriteDcpRank(strategies::Strategy& strategy, torch::optim::Optimizer& opt, const std::string& path,
                  const std::vector<OptimizerGroup>& groups);
std::function<void()> PrepareDcpLoad(strategies::Strategy& strategy, torch::optim::Optimizer& opt,
                                     const DcpCheckpoint& ckpt, const std::string& path);

// Computes this rank's optimizer state from `state` (resharding for sharded
// strategies, by name for replicated ones) and returns the function that
// installs it. Throws shardtrain::Error naming `path`, with nothing changed,
// when the state does not fit (other optimizer, other parameters).
std::function<void()> PrepareOptimizerLoad(strategies::Strategy& strategy, torch::optim::Optimizer& opt,
                                           const FullOptimizerState& state, const std::string& path);

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_STATE_H_
