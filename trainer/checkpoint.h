// Full checkpoints: one file, written by rank 0, atomically (temporary file in
// the same directory, fsync, rename, fsync of the directory), so a crash
// mid-save never destroys the previous checkpoint.
//
// The file is a torch::pickle_save archive of a dict that Python loads with
// torch.load(path, weights_only=False) (checked with the pinned torch 2.11;
// the default weights_only=True rejects the pickler's container type tags,
// torch.jit._pickle.restore_type_tag):
//   "state_dict"        {name: tensor}  the model's full (unsharded) state dict
//   "optimizer_states"  [uint8 tensor]  one serialized LibTorch optimizer
//                                       archive per rank (sharded strategies
//                                       keep per-shard state: loaded into the
//                                       same strategy at the same world size;
//                                       elsewhere "optimizer_full" is used)
//   "epoch", "global_step", "batch_in_epoch", "world_size"  ints
//   "strategy"          str
//   "rng_state"         uint8 tensor (CPU generator state)
//   "hparams"           {str: str}
// and, when present:
//   "optimizer_full"    {"kind": "Adam" | "AdamW" | "SGD",
//                        "state": {param name: {"exp_avg": tensor, ...}},
//                        "step": {param name: int}}
//                       the optimizer state consolidated by parameter name
//                       (full, unsharded tensors shaped like the parameter);
//                       loadable at any world size and by any strategy
//   "callbacks"         {callback key: {str: str}}  callback states (ModelCheckpoint, EarlyStopping)
//
// Sharded checkpoints (a directory with one file per rank) are in
// trainer/sharded_checkpoint.h; //tools:consolidate turns one into this format.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardtrain::trainer {

// Optimizer state by parameter name, unsharded. Supported optimizers: Adam and
// AdamW (keys exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad; a step per
// parameter) and SGD (momentum_buffer).
struct FullOptimizerState {
  std::string kind;  // "Adam", "AdamW", "SGD"; "" = none
  std::map<std::string, std::map<std::string, at::Tensor>> state;  // param name -> key -> tensor
  std::map<std::string, int64_t> step;                             // param name -> step (Adam, AdamW)
  bool empty() const { return kind.empty(); }
};

struct CheckpointData {
  std::map<std::string, at::Tensor> state_dict;
  std::vector<std::string> optimizer_states;  // serialized archives, by rank
  int64_t epoch = 0;
  int64_t global_step = 0;
  int64_t batch_in_epoch = 0;  // batches of `epoch` already consumed
  int64_t world_size = 1;
  std::string strategy;
  at::Tensor rng_state;
  std::map<std::string, std::string> hparams;
  FullOptimizerState optimizer_full;  // optional (empty kind: not saved)
  std::map<std::string, std::map<std::string, std::string>> callbacks;  // optional
};

// Writes atomically; throws shardtrain::Error on I/O failure (the previous file
// at `path`, if any, is untouched then).
void SaveCheckpoint(const std::string& path, const CheckpointData& data);

// Reads and validates a checkpoint. A missing, truncated or corrupt file, or
// one without the expected entries, throws shardtrain::Error naming the path.
CheckpointData LoadCheckpoint(const std::string& path);

// Writes `bytes` to `path` atomically (temp file, fsync, rename, fsync dir).
void WriteFileAtomically(const std::string& path, const std::string& bytes);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_H_
