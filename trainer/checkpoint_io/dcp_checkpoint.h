// Sharded checkpoints as Lightning 2.x's FSDPStrategy writes them
// (state_dict_type="sharded"): a PyTorch DCP directory
// (trainer/checkpoint_io/dcp.h) of the nested state dict
//
//   {"model":       {fqn: tensor},
//    "optimizer_0": {"state": {fqn: {"exp_avg": tensor, ..., "step": 0-d tensor}},
//                    "param_groups": [{"lr": ..., ..., "params": [fqn]}]}}
//
// (the layout torch.distributed.checkpoint.state_dict's get_state_dict
// gives), one file per rank, plus meta.pt (rank 0) with the rest of the
// checkpoint (SaveCheckpointMeta: epoch, loops, callbacks, hyper-parameters,
// schedulers, ShardTrain's own state). Each rank writes the chunks of its
// own shards (boxes of each parameter's global shape, dcp::BoxesOfRange) and
// reads only the chunks that overlap its shards. Saving goes through the
// temporary directory of trainer/checkpoint_io/sharded_checkpoint.h and is
// swapped into place the same way; .metadata is written last.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_DCP_CHECKPOINT_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_DCP_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp.h"

namespace shardtrain::trainer {

inline constexpr const char* kDcpMetaFile = "meta.pt";

// True when `path` is a directory holding DCP's .metadata.
bool IsDcpCheckpoint(const std::string& path);

// The paths of the state dict's entries.
std::vector<dcp::PathPart> DcpModelPath(const std::string& fqn);                               // model.<fqn>
std::vector<dcp::PathPart> DcpOptimizerStatePath(const std::string& fqn, const std::string& key);  // optimizer_0.state.<fqn>.<key>
std::vector<dcp::PathPart> DcpParamGroupPath(int64_t group, const std::string& option);        // optimizer_0.param_groups.<g>.<option>

// Records a tensor chunk (or a value) under `path` in `md` (its key, path, dtype and shape).
void AddDcpChunk(dcp::Metadata& md, const std::vector<dcp::PathPart>& path, at::ScalarType dtype,
                 const std::vector<int64_t>& shape, const dcp::Chunk& chunk);
void AddDcpObject(dcp::Metadata& md, const std::vector<dcp::PathPart>& path, const dcp::Location& where);

// The optimizer's parameter groups as DCP values (rank 0 writes them):
// each option and "params" (the groups' parameter names).
void WriteDcpParamGroups(dcp::RankFileWriter& file, const std::vector<OptimizerGroup>& groups, dcp::Metadata& md);

// Saving, after BeginShardedSave(path) on rank 0: every rank writes its
// file, dcp::RankFileName(rank), into ShardedTempDir(path), then its part of
// the metadata (WriteDcpPart); then rank 0 FinishDcpSave: merges the parts
// (the chunks of each tensor must cover it exactly: a rank that wrote too
// little or too much is named), writes meta.pt and .metadata, and swaps
// the directory into place. shardtrain::Error naming the file on failure.
void WriteDcpPart(const std::string& path, int64_t rank, const dcp::Metadata& part);
void FinishDcpSave(const std::string& path, const CheckpointData& meta, int64_t world_size);

// An open DCP checkpoint: meta.pt's entries (when the directory has none,
// as when PyTorch's dcp.save wrote it: world_size 0, position 0) and the
// reader. The model's tensors are the keys under `model_prefix` ("model."
// as Lightning and get_state_dict write them, or "" for a model state dict
// saved directly), the optimizer's under `optimizer_prefix` ("optimizer_0.",
// "optim." or "optimizer."; "" when there is none).
struct DcpCheckpoint {
  CheckpointData meta;
  std::string optimizer_kind;  // from meta.pt, else "" (the run's optimizer decides)
  std::shared_ptr<const dcp::Reader> reader;
  std::string model_prefix;
  std::string optimizer_prefix;
  // The optimizer's per-parameter state keys: fqn -> key -> the DCP key
  // ("step" included, as a 0-d tensor).
  std::map<std::string, std::map<std::string, std::string>> optimizer_state_keys;
};
DcpCheckpoint OpenDcpCheckpoint(const std::string& path);

// The full tensor of `key`, assembled from its chunks (fresh memory).
at::Tensor AssembleDcpTensor(const dcp::Reader& reader, const std::string& key);

// The whole checkpoint in memory (state_dict with every parameter and
// buffer, the optimizer state by name): for //tools:consolidate and for
// strategies that hold the full model. `run_kind` names the optimizer when
// meta.pt does not ("Adam", "AdamW", "SGD"; "" picks from the state's keys).
CheckpointData ConsolidateDcpCheckpoint(const DcpCheckpoint& ck, const std::string& run_kind = "");

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_DCP_CHECKPOINT_H_
