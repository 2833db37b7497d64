// Internal to //trainer: an asynchronous sharded save
// (TrainerOptions::async_checkpoint): this rank's DcpRankWriter
// (dcp_rank_writer.h) runs on a background thread while training goes on.
//
// The checkpoint is the state at the step boundary where the save began:
// the writer streams each unit from the live shards and optimizer state,
// and only the optimizer step changes those, so the step goes unit by unit
// (StepOptimizer), in the order the writer allows (NextUnit): first the
// units the writer has written; then units it has not reached, copied aside
// (copy-on-write: the writer takes the copy) while the copies held stay
// within the budget, the units it will reach last first; then it waits for
// the writer. Extra memory is therefore at most the budget
// (TrainerOptions::async_checkpoint_max_extra_memory, a fraction of what the
// rank writes), each copy freed once written, never a staging copy of the
// whole state; a unit larger than the budget is waited for, never copied.
// The writer never communicates: the training thread finds out in the
// step's one collective whether every rank's writer finished or failed
// (checkpoint_connector.h).
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_ASYNC_SAVE_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_ASYNC_SAVE_H_

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "trainer/checkpoint_io/checkpoint.h"

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer::internal {

class DcpRankWriter;

// What one asynchronous save cost this rank.
struct AsyncSaveStats {
  double write_seconds = 0;      // the writer thread's time
  int units = 0;                 // units written
  int units_copied = 0;          // of which copied aside first
  int64_t peak_extra_bytes = 0;  // the most held aside at once
  int64_t budget_bytes = 0;      // what it could hold aside
  double wait_seconds = 0;       // the optimizer's waits for the writer
};

class AsyncSave {
 public:
  // Starts writing on a new thread. `meta` is what rank 0 writes as meta.pt
  // when every rank's writer has finished. `max_extra_fraction`: the copies
  // held aside at once stay within this fraction of the bytes this rank
  // writes (0: none, the optimizer waits for the writer instead).
  AsyncSave(std::unique_ptr<DcpRankWriter> writer, std::string path, CheckpointData meta, double max_extra_fraction);
  // Waits for the writer (its file stays in the temporary directory).
  ~AsyncSave();
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  // optimizer.step() while this save is in flight: unit by unit with
  // copy-on-write (an optimizer over tensors of no single unit: every unit
  // written or copied first); a plain step once the writer finished or
  // where this rank writes no units.
  void StepOptimizer(torch::optim::Optimizer& opt);
  // The writer has returned (written everything, or failed).
  bool finished() const { return finished_.load(); }
  // Waits for the writer; then error() is "" or what failed.
  void Join();
  const std::string& error() const { return error_; }
  const std::string& path() const { return path_; }
  const CheckpointData& meta() const { return meta_; }
  AsyncSaveStats stats() const;

 private:
  enum class UnitState { kPending, kWriting, kWritten };
  void Run();
  // Which of `todo` (units in the writer's numbering) the optimizer may
  // change now: written, or copied aside here; waits for the writer when
  // none is.
  int NextUnit(const std::vector<int>& todo);
  void CopyAsideLocked(int u);

  std::unique_ptr<DcpRankWriter> writer_;
  std::vector<int> unit_of_;  // DcpRankWriter::unit_of_optimizer_tensors
  std::string path_;
  CheckpointData meta_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<UnitState> state_;
  std::vector<int64_t> aside_bytes_;  // per unit, while held aside
  std::vector<int64_t> unit_bytes_;   // what a copy of each unit takes
  AsyncSaveStats stats_;
  int64_t extra_bytes_ = 0;
  std::string error_;
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

// optimizer.step() one unit at a time: the tensors of unit u (unit_of[i] for
// the optimizer's i-th tensor, OptimizerParams' order) keep their gradients
// and the others' are hidden; next(todo) picks the unit to step among those
// left with a gradient (it may wait). Tensors without a gradient are skipped
// as step() skips them. The same update as one step(), in any order of the
// units, for optimizers that update each tensor on its own (Adam, AdamW, SGD).
void StepOptimizerByUnit(torch::optim::Optimizer& opt, const std::vector<int>& unit_of,
                         const std::function<int(const std::vector<int>& todo)>& next);

// Milliseconds the writer waits before each unit: SHARDTRAIN_ASYNC_SAVE_UNIT_DELAY_MS
// (0 when unset). A diagnostic knob that slows the writer so that the optimizer
// reaches units first; the tests use it to exercise copy-on-write.
int AsyncSaveUnitDelayMs();

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_ASYNC_SAVE_H_
