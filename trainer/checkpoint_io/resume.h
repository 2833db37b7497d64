// Where the runs under a root directory keep their checkpoints, which one is
// the newest, and cleaning up after killed saves. Used by Trainer::Fit for
// ckpt_path="last", TrainerOptions::resume="auto" and at every start.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_RESUME_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_RESUME_H_

#include <string>
#include <vector>

namespace shardtrain::trainer {

// The file that marks a sharded checkpoint directory complete (equal to
// kShardedCompleteMarker of trainer/checkpoint_io/sharded_checkpoint.h; this header stays
// free of torch).
inline constexpr const char* kCompleteMarkerName = "COMPLETE";
// A PyTorch DCP directory is complete once its .metadata is there (written last).
inline constexpr const char* kDcpMetadataName = ".metadata";

// The checkpoint directories of the runs under `root_dir`: every
// <root_dir>/<logger_name>/version_N/checkpoints and <root_dir>/checkpoints
// (runs without logger), those that exist.
std::vector<std::string> RunCheckpointDirs(const std::string& root_dir, const std::string& logger_name);

// The newest complete checkpoint in those directories: a full checkpoint
// file (*.ckpt; written by rename, so complete once visible) or a sharded
// directory holding its COMPLETE marker or DCP .metadata, by modification time — the last one
// written by the newest run, whether periodic, at a preemption or at the end
// (never an older run's last.ckpt when a newer run saved later). "" if none.
std::string FindLatestCheckpoint(const std::string& root_dir, const std::string& logger_name);
// TrainerOptions::resume's values: never, auto.
const std::vector<std::string>& ResumeModes();

// Removes what killed saves left in those directories (RemoveStaleTemporaries:
// ".NAME.tmp.<pid>" files of dead processes, ".NAME.tmp-sharded" directories).
// Returns the removed paths.
std::vector<std::string> RemoveCheckpointLitter(const std::string& root_dir, const std::string& logger_name);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_RESUME_H_
