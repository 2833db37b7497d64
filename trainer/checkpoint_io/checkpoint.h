// Full checkpoints: one file, written by rank 0, atomically (temporary file in
// the same directory, fsync, rename, fsync of the directory), so a crash
// mid-save never destroys the previous checkpoint.
//
// The file is the zip archive torch.save writes (one "data.pkl" pickle plus
// one record per tensor storage), pickled without LibTorch's container type
// tags (PickleSavePlain below), so Python's torch.load(path) reads it with the
// default weights_only=True (checked with the pinned torch 2.11) and
// LibTorch's torch::pickle_load reads it too. It is a dict:
//   "state_dict"        {name: tensor}  the model's full (unsharded) state dict
//   "optimizer_states"  [uint8 tensor]  one serialized LibTorch optimizer
//                                       archive per rank, only for optimizers
//                                       "optimizer_full" cannot restore (not
//                                       Adam, AdamW or SGD); empty otherwise.
//                                       Sharded strategies keep per-shard
//                                       state: such a file then resumes only
//                                       the same strategy at the same world
//                                       size. (Files of earlier versions hold
//                                       both forms.)
//   "epoch", "global_step", "batch_in_epoch", "world_size"  ints
//   "strategy"          str
//   "rng_state"         uint8 tensor (CPU generator state)
//   "hparams"           {str: str}
// and, when present:
//   "cuda_rng_states"   [uint8 tensor]  each CUDA device's generator state,
//                       by device index (torch.cuda.get_rng_state_all());
//                       written where CUDA devices are visible
//   "optimizer_full"    {"kind": "Adam" | "AdamW" | "SGD",
//                        "state": {param name: {"exp_avg": tensor, ...}},
//                        "step": {param name: int}}
//                       the optimizer state consolidated by parameter name
//                       (full, unsharded tensors shaped like the parameter);
//                       loadable at any world size and by any strategy
//   "callbacks"         {callback key: {str: str}}  callback states (ModelCheckpoint, EarlyStopping)
//   "lr_schedulers"     [{str: str}]  per lr scheduler of configure_optimizers,
//                       in order: its state_dict() (trainer/optim/lr_scheduler.h:
//                       "type", "last_epoch", ...) plus "optimizer_lrs" and
//                       "optimizer_momentums" (the optimizer's lr and
//                       momentum/beta1 per parameter group, comma-separated;
//                       "optimizer_full" does not keep them)
//   "grad_scaler"       {"scale": float, "growth_factor": float,
//                        "backoff_factor": float, "growth_interval": int,
//                        "_growth_tracker": int}  the loss scaler of
//                       "16-mixed" runs (trainer/optim/grad_scaler.h; the keys of
//                       torch.amp.GradScaler.state_dict())
//
// Sharded checkpoints (a directory with one file per rank) are in
// trainer/checkpoint_io/sharded_checkpoint.h; //tools:consolidate turns one into this format.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_CHECKPOINT_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_CHECKPOINT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/file_util.h"  // WriteFileAtomically (kept reachable from here)
#include "trainer/optim/grad_scaler.h"

namespace c10 {
struct IValue;
}

namespace shardtrain::trainer {

class ArchiveWriter;

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
  std::vector<at::Tensor> cuda_rng_states;  // optional: by CUDA device index
  std::map<std::string, std::string> hparams;
  FullOptimizerState optimizer_full;  // optional (empty kind: not saved)
  std::map<std::string, std::map<std::string, std::string>> callbacks;  // optional
  std::optional<GradScalerState> grad_scaler;                           // optional ("16-mixed")
  std::vector<std::map<std::string, std::string>> lr_schedulers;        // optional (empty: none)
};

// Writes atomically; throws shardtrain::Error on I/O failure (the previous file
// at `path`, if any, is untouched then). Each tensor is written as it is
// reached (trainer/checkpoint_io/archive.h): no copy of the whole state is made.
void SaveCheckpoint(const std::string& path, const CheckpointData& data);

// Adds the entries of `data` to `writer` and finishes the file. Where
// `streamed_state_dict` / `streamed_optimizer_full` are not None they are
// the "state_dict" / "optimizer_full" entries, built from placeholders
// already added to `writer` (tensors streamed one unit at a time), and
// data.state_dict / data.optimizer_full are not used.
void FinishCheckpoint(ArchiveWriter& writer, const CheckpointData& data, const c10::IValue& streamed_state_dict,
                      const c10::IValue& streamed_optimizer_full);


// Reads and validates a checkpoint; its tensors are zero-copy views of the
// memory-mapped file (MapArchive), read from disk only where touched. A missing, truncated or corrupt file, or
// one without the expected entries, throws shardtrain::Error naming the path.
CheckpointData LoadCheckpoint(const std::string& path);

// The bytes torch::pickle_save(value) would give — torch.save's zip archive —
// but pickled without container type tags (torch.jit._pickle.restore_type_tag,
// build_intlist, ...), which Python's weights_only unpickler rejects: every
// list is written as a plain list, every dict as a plain dict. Python's
// torch.load then needs no weights_only=False; LibTorch's pickle_load reads
// the lists back as generic lists (elements typed Any) and the dicts as
// generic dicts. Used for full checkpoints and sharded-checkpoint files.
std::string PickleSavePlain(const c10::IValue& value);

// The "grad_scaler" entry (also in sharded-checkpoint metadata). From an
// IValue: throws c10::Error when keys are missing or mistyped.
c10::IValue GradScalerStateToIValue(const GradScalerState& state);
GradScalerState GradScalerStateFromIValue(const c10::IValue& value);
// The "lr_schedulers" entry (also in sharded-checkpoint metadata). From an
// IValue: throws c10::Error when it is not a list of {str: str}.
c10::IValue LRSchedulerStatesToIValue(const std::vector<std::map<std::string, std::string>>& states);
std::vector<std::map<std::string, std::string>> LRSchedulerStatesFromIValue(const c10::IValue& value);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_CHECKPOINT_H_
