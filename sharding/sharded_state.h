// Sharded state without a model: what a rank's piece of a sharded checkpoint
// holds, the state of the tensors an optimizer steps, and the model-free
// arithmetic over them (which saved piece is which shard rank, the saved
// flat layouts, consolidating a unit's shards into full tensors). Used by the
// sharding core (sharding/sharded_model.h, sharding/optimizer_state.h), by
// the Strategy interface (strategies/strategy.h) and by the trainer's
// checkpoint files and //tools:consolidate, which need no model.
#ifndef SHARDTRAIN_SHARDING_SHARDED_STATE_H_
#define SHARDTRAIN_SHARDING_SHARDED_STATE_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "sharding/shard_layout.h"

namespace shardtrain::sharding {

// What each unit looks like (for tests, logs and checkpoints).
struct UnitInfo {
  std::string name;  // module path of the wrap point ("" for the root)
  std::vector<std::string> param_names;
  int64_t numel = 0;
  int64_t padded_numel = 0;
  int64_t shard_numel = 0;
};

// Where a rank's stored tensor of a parameter lies in its global tensor when
// the parameter is split by tensor parallelism: along dimension `dim`, the
// stored tensor is `blocks`, each `length` rows starting at `stored_begin` in
// the stored tensor and at `global_begin` in the global one (one block, or
// one per chunk of a fused projection); the other dimensions are whole.
struct GlobalPiece {
  struct Block {
    int64_t stored_begin = 0, global_begin = 0, length = 0;
  };
  std::vector<int64_t> global_shape;
  int64_t dim = 0;
  std::vector<Block> blocks;
};

// A rank's piece of a sharded checkpoint: its shard of every unit plus the
// metadata needed to rebuild the full parameters at any world size.
// ShardedModel::GetShardedStateDict fills it without copies (on the CPU the
// shards and buffers are the model's own tensors: copy them to keep them
// past the next optimizer step); a loaded one may hold views of a mapped file.
struct ShardedStateDict {
  int shard_rank = 0;
  int shard_world = 1;
  std::vector<UnitInfo> units;
  std::vector<at::Tensor> shards;             // one per unit, float32
  std::map<std::string, at::Tensor> buffers;  // full buffers (replicated)
  // Per unit, the saved shape of each parameter (in units[i].param_names
  // order). Empty: the model's shapes are assumed.
  std::vector<std::vector<std::vector<int64_t>>> param_shapes;
  // Tensor parallelism: the parameters this rank stores a piece of (the
  // others are stored whole), and whether it writes the whole ones (the
  // first rank of its tensor-parallel group does: the others hold copies).
  // Without tensor parallelism: empty, and true.
  std::map<std::string, GlobalPiece> pieces;
  bool writes_whole = true;
  // HYBRID_SHARD and NO_SHARD: whether this rank is in the first replica
  // (its shard group writes; the other replicas hold equal shards).
  bool first_replica = true;
};

// The optimizer state of one tensor an optimizer steps: state tensors shaped
// like it by key ("exp_avg", "momentum_buffer", ...) and its step (-1: none).
struct OptimizerTensorState {
  std::map<std::string, at::Tensor> tensors;
  int64_t step = -1;
};
// Parallel to a list of optimized tensors; nullopt: no state.
using OptimizerStates = std::vector<std::optional<OptimizerTensorState>>;

// A rank's optimizer state in the flat layout of its shards: per unit, state
// tensors shaped like the unit's shard by key (an empty map: none), and the
// unit's step (-1: none). It reshards exactly like the parameters.
struct ShardedOptimizerState {
  std::vector<std::map<std::string, at::Tensor>> units;
  std::vector<int64_t> steps;
};

// One unit's optimizer state laid out like its shard: state tensors by key
// (shard_numel float32 elements each; empty: none) and the unit's step.
struct UnitShardState {
  std::map<std::string, at::Tensor> tensors;
  int64_t step = -1;
};

// For each shard rank of the run that saved `pieces`, the index of its piece
// (HYBRID_SHARD replicas hold equal shards: the first is taken). Throws
// InvalidArgumentError when the pieces disagree on the shard group or one is
// missing.
std::vector<size_t> PieceOfShardRank(const std::vector<ShardedStateDict>& pieces);

// The saved flat layout of every unit of pieces[0] (parameter sizes from the
// saved shapes, else `fallback_numel` by name); sizes that do not add up and
// pieces that lack a unit's shard are added to `problems`, one line each.
std::vector<FlatUnitLayout> SavedLayouts(const std::vector<ShardedStateDict>& pieces,
                                         const std::vector<size_t>& by_shard_rank,
                                         const std::map<std::string, int64_t>& fallback_numel,
                                         std::vector<std::string>* problems);

// Consolidation: the full tensors of one unit by parameter name (float32,
// fresh memory), from the unit's shard on each shard rank in order and the
// parameters' shapes (in unit.param_names order). Needs no model.
std::map<std::string, at::Tensor> ConsolidateUnit(const UnitInfo& unit,
                                                  const std::vector<std::vector<int64_t>>& shapes,
                                                  const std::vector<at::Tensor>& shards_by_rank);

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_SHARDING_SHARDED_STATE_H_
