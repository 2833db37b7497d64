// Internal to //trainer: the checkpoint connector — writing the Trainer's
// state as a full or sharded checkpoint, restoring it, and finding what
// ckpt_path names; collective over the ranks, and on failure every rank
// throws with nothing changed (trainer/trainer.h, "Checkpoints").
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_CONNECTOR_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_CONNECTOR_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "trainer/checkpoint_io/state_value.h"
#include "trainer/trainer_options.h"  // CheckpointFormat

namespace shardtrain::trainer {

class Trainer;
struct CheckpointData;
struct DcpCheckpoint;  // trainer/checkpoint_io/dcp_checkpoint.h

namespace internal {

struct GroupLrs;  // checkpoint_state.h

class CheckpointConnector {
 public:
  explicit CheckpointConnector(Trainer& trainer) : t_(trainer) {}
  CheckpointConnector(const CheckpointConnector&) = delete;
  CheckpointConnector& operator=(const CheckpointConnector&) = delete;

  // Trainer::SaveCheckpoint.
  void Save(const std::string& path, CheckpointFormat format);
  // Restores model, optimizer, schedulers, scaler, RNG, loop position and
  // callback states from `path` (full file or sharded directory); checks
  // everything before it changes anything.
  void Restore(const std::string& path);
  // "" (start afresh), the given path, or for "last" (and resume="auto"
  // without a path) the newest complete checkpoint: rank 0 decides, every
  // rank uses it. Also removes what killed saves of earlier runs left behind.
  std::string ResolveCheckpointPath(const std::string& ckpt_path);

 private:
  void SaveFull(const std::string& path);
  void SaveSharded(const std::string& path);
  // Every rank's serialized optimizer (LibTorch archives), in rank order.
  std::vector<std::string> GatherOptimizerStates();
  // The callbacks' state_dict()s and (under kExtraStateKey) what the
  // on_save_checkpoint hooks write.
  std::map<std::string, StateDict> CallbackStates();
  // Fills what every save records besides the model and optimizer state
  // (collective: the optimizer's groups are agreed on by every rank).
  void FillCommon(CheckpointData& data);
  GroupLrs NameLoadedState(CheckpointData& ck, const std::string& path);
  void RestoreRngAndCallbacks(const CheckpointData& ck, const std::string& path);
  // PrepareDcpLoad (trainer/connectors/internal/checkpoint_state.h) on every
  // rank, then AgreeOrThrow: a problem on any rank stops all.
  std::function<void()> PrepareDcpLoadAgreed(const DcpCheckpoint& dcp, const std::string& path);
  // Throws on every rank when `failed` on any: a failed rank its own
  // message, the others "<what> failed on rank r: <its message>" (the
  // highest failed rank's).
  void AgreeOrThrow(bool failed, const std::string& message, const std::string& what);

  Trainer& t_;
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_CONNECTOR_H_
