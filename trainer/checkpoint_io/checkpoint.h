// Full checkpoints: one file, written by rank 0, atomically (temporary file in
// the same directory, fsync, rename, fsync of the directory), so a crash
// mid-save never destroys the previous checkpoint.
//
// The file is the zip archive torch.save writes (one "data.pkl" pickle plus
// one record per tensor storage), pickled without LibTorch's container type
// tags (PickleSavePlain below), so Python's torch.load(path) reads it with the
// default weights_only=True (checked with the pinned torch) and LibTorch's
// torch::pickle_load reads it too. Its layout is the one Lightning 2.x writes
// (docs/checkpoints.md shows the Python that reads it), a dict of:
//   "state_dict"         {name: tensor}  the model's full (unsharded) state dict
//   "optimizer_states"   [torch.optim state_dict()]  for Adam, AdamW and SGD:
//                        {"state": {index: {"step": float32 0-d tensor (Adam,
//                        AdamW), "exp_avg", "exp_avg_sq", ["max_exp_avg_sq"] |
//                        "momentum_buffer": tensor shaped like the parameter}},
//                        "param_groups": [{"lr", "betas", "eps", ... as
//                        torch.optim writes them, "params": [index],
//                        "param_names": [name]}]}; the index is the
//                        parameter's position in the optimizer's groups, in
//                        order. Empty for other optimizers (see "shardtrain").
//   "lr_schedulers"      [dict]  each scheduler's state_dict() with its Python
//                        keys and types ("last_epoch", "base_lrs", "_last_lr",
//                        ...); always present
//   "epoch", "global_step"  ints; "pytorch-lightning_version" str
//   "loops"              {"fit_loop": {...}}  Lightning's loop progress counters
//                        for the same position (always present)
//   "callbacks"          {state key: {key: value}}  ModelCheckpoint and
//                        EarlyStopping under Lightning's keys and types
//   "hyper_parameters"   {str: int | float | bool | str}  (TrainingModule::hyper_parameters())
//   "hparams_name"       "kwargs"
//   "MixedPrecision"     torch.amp.GradScaler.state_dict() of "16-mixed" runs
//   "shardtrain"         ShardTrain's own state, which Lightning ignores:
//                        {"world_size", "batch_in_epoch": int, "strategy": str,
//                        "rng_state": uint8 tensor (CPU generator),
//                        "cuda_rng_states": [uint8 tensor] (each CUDA device's),
//                        "optimizer_archives": [uint8 tensor] (one LibTorch
//                        archive per rank, for optimizers other than Adam,
//                        AdamW and SGD: such a file resumes only the same
//                        strategy at the same world size),
//                        "optimizer_kind": "Adam" | "AdamW" | "SGD" | "",
//                        "optimizer_groups": [{"param_names", "options"}]
//                        (the groups again, also for those optimizers),
//                        "format_version": 2}
//
// LoadCheckpoint also reads the files of earlier releases (keys "hparams",
// "optimizer_full", ...) and files Python Lightning wrote (their optimizer
// state is by index until NameOptimizerState names it).
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
#include "trainer/checkpoint_io/state_value.h"
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

// One parameter group of the optimizer: the parameters it steps, by name, in
// the optimizer's order, and its options as torch.optim writes them ("lr",
// "betas", "eps", "weight_decay", "momentum", ...).
struct OptimizerGroup {
  std::vector<std::string> params;
  StateDict options;
};

// Optimizer state as a file from Python holds it: by parameter index.
struct IndexedOptimizerState {
  std::map<int64_t, std::map<std::string, at::Tensor>> state;  // index -> key -> tensor
  std::map<int64_t, int64_t> step;                             // index -> step (Adam, AdamW)
  std::vector<int64_t> group_sizes;                            // parameters per group
  bool empty() const { return state.empty() && group_sizes.empty(); }
};

struct CheckpointData {
  std::map<std::string, at::Tensor> state_dict;
  std::vector<std::string> optimizer_states;  // LibTorch archives by rank (optimizers other than Adam, AdamW, SGD)
  int64_t epoch = 0;
  int64_t global_step = 0;
  int64_t batch_in_epoch = 0;  // batches of `epoch` already consumed
  int64_t world_size = 1;
  std::string strategy;
  at::Tensor rng_state;
  std::vector<at::Tensor> cuda_rng_states;  // optional: by CUDA device index
  StateDict hparams;                        // "hyper_parameters"
  FullOptimizerState optimizer_full;        // optional (empty kind: not saved)
  // Saving: the optimizer's groups (names and options); required with
  // optimizer_full. Loading: the groups the file holds (names empty where
  // the file does not name its parameters).
  std::vector<OptimizerGroup> optimizer_groups;
  // Loading a file without parameter names (written by Python): the state by
  // index, for NameOptimizerState; optimizer_full is empty then.
  IndexedOptimizerState optimizer_indexed;
  std::map<std::string, StateDict> callbacks;                     // optional
  std::optional<GradScalerState> grad_scaler;                     // optional ("16-mixed")
  std::vector<std::map<std::string, std::string>> lr_schedulers;  // optional (empty: none); text form (SchedulerState)
  int64_t accumulate_grad_batches = 1;                            // saving: for Lightning's batch counters
  int64_t batches_in_epoch = 0;  // saving: the epoch's batch count (Lightning's is_last_batch); 0: unknown
  bool legacy_layout = false;    // loading: a file of an earlier ShardTrain release
};

// Names the optimizer state of a file that holds it by index (CheckpointData::
// optimizer_indexed): `groups` are this run's optimizer's parameter names by
// group, in order; `kind` its kind ("Adam", "AdamW", "SGD"). Fills
// ck.optimizer_full. Throws shardtrain::Error naming `path` when the groups'
// sizes differ from the file's or the state's keys are not `kind`'s.
void NameOptimizerState(CheckpointData& ck, const std::vector<std::vector<std::string>>& groups,
                        const std::string& kind, const std::string& path);

// Writes atomically; throws shardtrain::Error on I/O failure (the previous file
// at `path`, if any, is untouched then). Each tensor is written as it is
// reached (trainer/checkpoint_io/archive.h): no copy of the whole state is made.
void SaveCheckpoint(const std::string& path, const CheckpointData& data);

// The Lightning release whose layout the full checkpoint has (the pinned one
// in tools/bootstrap.sh), written as "pytorch-lightning_version"; and
// ShardTrain's own format version ("shardtrain"/"format_version"; the files
// of earlier releases, without it, are format 1).
inline constexpr const char* kLightningVersion = "2.6.6";
inline constexpr int64_t kFormatVersion = 2;

// Adds the entries of `data` to `writer` and finishes the file. Where
// `streamed_state_dict` is not None it is the "state_dict" entry, and where
// `streamed_optimizer_full` is not null it is the optimizer state by name,
// both built from placeholders already added to `writer` (tensors streamed
// one unit at a time); data.state_dict / data.optimizer_full are not used
// then. data.optimizer_groups say the parameters' order (their indices).
void FinishCheckpoint(ArchiveWriter& writer, const CheckpointData& data, const c10::IValue& streamed_state_dict,
                      const FullOptimizerState* streamed_optimizer_full);

// A sharded checkpoint's meta.pt as Lightning writes it: the entries of the
// full checkpoint except "state_dict" and "optimizer_states" (those are in
// the DCP files); and back (the entries LoadCheckpoint reads, but for those two).
void SaveCheckpointMeta(const std::string& path, const CheckpointData& data);
CheckpointData LoadCheckpointMeta(const std::string& path);

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
// Typed state ("hyper_parameters", a callback's state; also in sharded-checkpoint
// metadata) with score tensors as plain tensors; back, skipping values
// StateValue has no form for (throws c10::Error when `v` is not a dict).
c10::IValue StateDictToIValue(const StateDict& d);
StateDict StateDictFromIValue(const c10::IValue& v);
// The optimizer's groups, [{"param_names": [str], "options": dict}] (sharded-checkpoint metadata).
c10::IValue OptimizerGroupsToIValue(const std::vector<OptimizerGroup>& groups);
std::vector<OptimizerGroup> OptimizerGroupsFromIValue(const c10::IValue& v);
// The "lr_schedulers" entry (also in sharded-checkpoint metadata): each value
// with its Python type (ints, floats, lists of floats; nested schedulers'
// states, SequentialLR's "0.last_epoch", as "_schedulers": [dict]). From an
// IValue: also the all-strings lists of earlier releases; throws c10::Error
// for anything else.
c10::IValue LRSchedulerStatesToIValue(const std::vector<std::map<std::string, std::string>>& states);
std::vector<std::map<std::string, std::string>> LRSchedulerStatesFromIValue(const c10::IValue& value);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_CHECKPOINT_H_
