// Internal to //trainer: moving model and optimizer state between a strategy
// and checkpoint structures (trainer/checkpoint.h, trainer/sharded_checkpoint.h).
//
// Optimizer state is handled generically for Adam, AdamW and SGD: per
// optimized tensor, the state tensors shaped like it (exp_avg, exp_avg_sq,
// max_exp_avg_sq, momentum_buffer) and Adam's step. For sharded strategies an
// optimized tensor is a unit's shard (or, with use_orig_params, one
// parameter's part of it), so its state is laid out like the unit's flat
// parameter and reshards the same way. Other optimizers are saved as their
// LibTorch archive (same world size only).
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_STATE_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_STATE_H_

#include <functional>
#include <string>

#include "strategies/strategy.h"
#include "trainer/checkpoint.h"
#include "trainer/sharded_checkpoint.h"

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer::internal {

// "Adam", "AdamW", "SGD", or "" for optimizers without reshardable state support.
std::string OptimizerKind(const torch::optim::Optimizer& opt);
// The LibTorch archive of the optimizer (state and parameter groups).
std::string SerializeOptimizer(const torch::optim::Optimizer& opt);
// Loads an archive; throws shardtrain::Error naming `path` when it does not fit.
void LoadOptimizerArchive(torch::optim::Optimizer& opt, const std::string& bytes, const std::string& path);

// The optimizer state by parameter name (unsharded). Collective for sharded
// strategies: every rank calls; every rank gets the result. Empty kind for
// unsupported optimizers.
FullOptimizerState GatherFullOptimizerState(strategies::Strategy& strategy, torch::optim::Optimizer& opt);

// This rank's piece of a sharded checkpoint (no communication). The strategy
// must be sharded (sharded_model_or_null() != nullptr).
ShardedPiece MakeShardedPiece(strategies::Strategy& strategy, torch::optim::Optimizer& opt);

// Loading a sharded checkpoint into a sharded strategy at any world size
// without building the full model: checks the saved layout against the
// model (names and sizes; the error lists every problem), computes this
// rank's optimizer state from only the ranges of the (mapped) source shards
// that overlap this rank's shards, and returns the function that installs
// parameters, buffers and optimizer state. Throws shardtrain::Error naming
// `path`, with nothing changed, when the checkpoint does not fit.
std::function<void()> PrepareShardedLoad(strategies::Strategy& strategy, torch::optim::Optimizer& opt,
                                         const ShardedCheckpoint& ckpt, const std::string& path);

// Computes this rank's optimizer state from `state` (resharding for sharded
// strategies, by name for replicated ones) and returns the function that
// installs it. Throws shardtrain::Error naming `path`, with nothing changed,
// when the state does not fit (other optimizer, other parameters).
std::function<void()> PrepareOptimizerLoad(strategies::Strategy& strategy, torch::optim::Optimizer& opt,
                                           const FullOptimizerState& state, const std::string& path);

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_STATE_H_
