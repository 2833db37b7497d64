// Sharded checkpoints: a directory with one file per rank plus metadata, for
// sharded strategies (fsdp_native with state_dict_type=sharded). No rank ever
// holds the full model to save; loading reshards to any world size.
//
//   <dir>/metadata.pt   written by rank 0: "format" ("shardtrain.sharded"),
//                       "format_version", "world_size", "epoch", "global_step",
//                       "batch_in_epoch", "strategy", "rng_state",
//                       "hyper_parameters" (typed; format 1: "hparams", strings),
//                       "callbacks", "optimizer_groups" (the optimizer's
//                       parameter names and options per group, for the full
//                       checkpoint's parameter indices), "files" (the rank files, by rank) and,
//                       for "16-mixed" runs, "grad_scaler", and where CUDA
//                       devices are visible "cuda_rng_states" (as in full
//                       checkpoints, trainer/checkpoint_io/checkpoint.h)
//   <dir>/rank_<r>.pt   rank r's piece (ShardedPiece below):
//       "rank", "world_size", "shard_rank", "shard_world"   ints
//       "units"    [{"name", "param_names": [str], "param_shapes": [[int]],
//                    "numel", "padded_numel", "shard_numel"}]
//       "shards"   [float32 tensor]  this rank's block of each unit's flat parameter
//       "buffers"  {name: tensor}
//       "optimizer" {"kind": str, "units": [{key: tensor shaped like the unit's
//                    shard}], "steps": [int], "archive": uint8 tensor}
//   <dir>/COMPLETE      written last: a directory without it is an unfinished save
//
// A unit's flat parameter is its parameters laid end to end (in param_names
// order), padded to shard_world * shard_numel; shard rank s holds the block
// [s * shard_numel, (s + 1) * shard_numel). The optimizer state of Adam, AdamW
// and SGD is stored the same way (exp_avg etc. of the unit's shard), so it
// reshards like the parameters; other optimizers store their LibTorch archive
// ("archive"), which only loads at the same world size.
//
// Every file is a torch.save-format archive without container type tags
// (PickleSavePlain, trainer/checkpoint_io/checkpoint.h): Python's torch.load(f) reads it
// with the default weights_only=True. A rank file is streamed
// (trainer/checkpoint_io/archive.h ArchiveWriter): each tensor's bytes go to the file from
// the live tensor, one at a time, so a save holds no copy of the shards or of
// the file. LoadShardedCheckpoint maps the rank files (MapArchive): its
// tensors are views of the files, read only where touched, so a rank that
// loads (Trainer, trainer/connectors/internal/checkpoint_state.h PrepareShardedLoad) reads only
// the byte ranges of the source shards that overlap its own new shards
// (sharding/shard_layout.h), copies each range straight into its shard or
// optimizer state, and drops the source record's pages from the process right
// after (trainer::ReleaseMappedPages under sharding::SourceReleaseScope): a
// rank holds at most one source record beyond its own state, never a whole
// rank file. Saving writes into a temporary sibling
// directory, fsyncs every file, writes COMPLETE last and then swaps the
// directory into place (renameat2 RENAME_EXCHANGE, or two renames where the
// file system lacks it), so an interrupted save never destroys the previous
// checkpoint at the same path. With several processes the directory must be
// on a file system every rank sees (rank 0 checks the other ranks' files).
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_SHARDED_CHECKPOINT_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_SHARDED_CHECKPOINT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "sharding/sharded_state.h"
#include "trainer/checkpoint_io/checkpoint.h"

namespace shardtrain::trainer {

inline constexpr int64_t kShardedCheckpointFormatVersion = 2;  // 2: typed "hyper_parameters", "optimizer_groups"
inline constexpr const char* kShardedMetadataFile = "metadata.pt";
inline constexpr const char* kShardedCompleteMarker = "COMPLETE";

// One rank's file: its piece of the sharding core's own state
// (sharding/sharded_state.h), as the core gives it on save and takes it on load.
struct ShardedPiece {
  int64_t rank = 0;
  int64_t world_size = 1;
  // The shard group (shard_rank, shard_world: HYBRID_SHARD replicas share a
  // shard rank), the units (FSDP wrap points) with their saved parameter
  // shapes (param_shapes: one list per unit, always filled), the unit shards
  // (shard_numel float32 elements each) and the full (replicated) buffers.
  sharding::ShardedStateDict state;
  std::string optimizer_kind;  // "Adam", "AdamW", "SGD", or "" (none / archive)
  // Per unit, state tensors shaped like its shard by key (empty map: none) and
  // its step (-1: none).
  sharding::ShardedOptimizerState optimizer;
  // When set (a save), WriteShardedPiece takes each unit's optimizer state
  // from here, one unit at a time, instead of from optimizer.units: state
  // that must be copied into the shard layout is never all alive at once.
  std::function<std::map<std::string, at::Tensor>(size_t unit)> optimizer_unit_source;
  std::string optimizer_archive;  // serialized LibTorch optimizer (unsupported kinds)
};

struct ShardedCheckpoint {
  // Loop state, RNG, hyperparameters, callbacks (state_dict and optimizer
  // fields are empty).
  CheckpointData meta;
  std::vector<ShardedPiece> pieces;  // by rank
};

// "rank_<r>.pt"
std::string ShardedPieceFileName(int64_t rank);
// True when `path` is a directory (a sharded checkpoint, finished or not).
bool IsShardedCheckpoint(const std::string& path);

// A collective save in three steps (the Trainer runs them on the ranks):
// rank 0 calls BeginShardedSave, then every rank WriteShardedPiece into the
// directory it returns, then rank 0 FinishShardedSave. All throw
// shardtrain::Error naming the file on I/O failure; `path` is untouched then.
// The temporary directory for `path` (the same on every rank).
std::string ShardedTempDir(const std::string& path);
void BeginShardedSave(const std::string& path);
void WriteShardedPiece(const std::string& path, const ShardedPiece& piece);
void FinishShardedSave(const std::string& path, const CheckpointData& meta);
// Fsyncs the temporary directory of `path` and swaps it into place (the
// previous directory at `path` is removed only after): FinishShardedSave's
// last step, also for the DCP layout (trainer/checkpoint_io/dcp_checkpoint.h).
void CommitShardedDir(const std::string& path);
// Single-process convenience: all three steps.
void SaveShardedCheckpoint(const std::string& path, const ShardedCheckpoint& ckpt);

// Reads the metadata and maps every rank file (zero-copy: the pieces' tensors
// are views of the files) and validates them: a missing COMPLETE marker,
// metadata or rank file, a truncated or corrupt file, or pieces that
// disagree with each other throw shardtrain::Error naming the file.
ShardedCheckpoint LoadShardedCheckpoint(const std::string& path);

// Consolidation (no model needed; builds the full state in memory: for
// //tools:consolidate and tests, not for loading into a sharded run): the
// full parameters by name, float32.
std::map<std::string, at::Tensor> ConsolidateParameters(const ShardedCheckpoint& ckpt);
// The optimizer state by parameter name (empty kind when none was saved in
// reshardable form).
FullOptimizerState ConsolidateOptimizerState(const ShardedCheckpoint& ckpt);
// The full checkpoint of the same state (what //tools:consolidate writes):
// state_dict (parameters and float32 buffers), optimizer_full, loop state,
// RNG, hyperparameters, callbacks; optimizer_states holds the per-rank
// archives when the optimizer was saved that way.
CheckpointData ConsolidateShardedCheckpoint(const ShardedCheckpoint& ckpt);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_SHARDED_CHECKPOINT_H_
