// Internal to //trainer: the checkpoint connector — writing the Trainer's
// state as a full or sharded checkpoint, restoring it, and finding what
// ckpt_path names; collective over the ranks, and on failure every rank
// throws with nothing changed (trainer/trainer.h, "Checkpoints").
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_CONNECTOR_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_CONNECTOR_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "trainer/checkpoint_io/state_value.h"
#include "trainer/trainer_options.h"  // CheckpointFormat

namespace shardtrain::trainer {

class Trainer;
struct CheckpointData;
struct DcpCheckpoint;  // trainer/checkpoint_io/dcp_checkpoint.h

namespace internal {

struct LoadedGroupLrs;  // checkpoint_state.h
class AsyncSave;      // async_save.h
class DcpRankWriter;  // dcp_rank_writer.h

class CheckpointConnector {
 public:
  explicit CheckpointConnector(Trainer& trainer);
  ~CheckpointConnector();  // waits for an asynchronous save's writer (without finishing the save)
  CheckpointConnector(const CheckpointConnector&) = delete;
  CheckpointConnector& operator=(const CheckpointConnector&) = delete;

  // Trainer::SaveCheckpoint. Waits for the save in flight first (at most
  // one); with TrainerOptions::async_checkpoint inside Fit, a sharded save
  // then starts this rank's background writer and returns
  // (trainer/connectors/internal/async_save.h); it is complete once
  // FinishAsyncSave has run.
  void Save(const std::string& path, CheckpointFormat format);

  // ---- Asynchronous saves (checkpoint_connector_async.cc) ----
  // optimizer.step(), unit by unit with copy-on-write while a save is in flight.
  void StepOptimizer();
  // This rank's slots for the step's collective: [the writer finished (1;
  // also when none is in flight), it failed (1)].
  std::vector<double> AsyncSaveSlots() const;
  // With the slots summed over the ranks (the step's collective, every rank
  // alike): when some writer failed, every rank throws shardtrain::Error
  // with its message (the save is dropped; the checkpoints before it are
  // intact); when all finished, FinishAsyncSave.
  void AfterAsyncSaveSlots(const std::vector<double>& summed);
  // Collective: waits for the save in flight, if any, and completes it:
  // rank 0 writes meta.pt and .metadata and swaps the directory in; then the
  // actions WhenSaved deferred run. Throws like a synchronous save.
  void FinishAsyncSave();
  // Not collective (Fit is leaving by an exception): waits for this rank's
  // writer and drops the save; its temporary directory stays for the next
  // run's resume to remove.
  void AbandonAsyncSave();
  // Runs `fn` (this rank) once the save in flight is complete, or now when
  // none is; never when it fails (ModelCheckpoint evicts its old files so).
  void WhenSaved(std::function<void()> fn);
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
  void SaveSharded(const std::string& path, bool async);
  void StartAsyncSave(std::unique_ptr<DcpRankWriter> writer, const std::string& path, CheckpointData meta);
  // Every rank's serialized optimizer (LibTorch archives), in rank order.
  std::vector<std::string> GatherOptimizerStates();
  // The callbacks' state_dict()s and (under kExtraStateKey) what the
  // on_save_checkpoint hooks write.
  std::map<std::string, StateDict> CallbackStates();
  // Fills what every save records besides the model and optimizer state
  // (collective: the optimizer's groups are agreed on by every rank).
  void FillCommon(CheckpointData& data);
  LoadedGroupLrs NameLoadedState(CheckpointData& ck, const std::string& path);
  void RestoreRngAndCallbacks(const CheckpointData& ck, const std::string& path);
  // PrepareDcpLoad (trainer/connectors/internal/checkpoint_state.h) on every
  // rank, then AgreeOrThrow: a problem on any rank stops all.
  std::function<void()> PrepareDcpLoadAgreed(const DcpCheckpoint& dcp, const std::string& path);
  // Throws on every rank when `failed` on any: a failed rank its own
  // message, the others "<what> failed on rank r: <its message>" (the
  // highest failed rank's).
  void AgreeOrThrow(bool failed, const std::string& message, const std::string& what);
  // fn() where `mine` (an exception is its failure), then AgreeOrThrow.
  void RunAgreed(bool mine, const std::function<void()>& fn, const std::string& what);
  // On rank 0: removes the temporary directory of a failed sharded save of
  // `path` (called on every rank once no rank writes there).
  void DropShardedSave(const std::string& path);

  Trainer& t_;
  std::unique_ptr<AsyncSave> async_;
  std::vector<std::function<void()>> when_saved_;
  bool warned_full_sync_ = false;
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_CHECKPOINT_CONNECTOR_H_
