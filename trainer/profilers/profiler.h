// Profilers of Trainer::Fit (Lightning's profiler="simple" / "pytorch";
// TrainerOptions::profiler).
//
// The fit loop marks its phases with ProfileScope (an inert object when
// profiling is off: one null check per phase):
//   get_train_batch   fetching a training batch (and moving it to the device)
//   training_step     the module's forward and loss
//   backward          Strategy::Backward (gradient synchronization included)
//   optimizer_step    clipping, the LR schedule, optimizer.step, zero_grad
//   validation        a validation pass (with its hooks)
//   save_checkpoint   Trainer::SaveCheckpoint (built-in and callbacks')
//   on_train_batch_end            the module's hook
//   callbacks.on_train_batch_end  the callbacks' hooks
//   on_train_epoch_end            the module's and callbacks' hooks
// and "simple" adds
//   communication_wait  time this rank's fit thread was blocked in Work::Wait
//                       (comm/wait_time.h): it overlaps the phases above.
// "simple" prints a table (action, calls, mean, total, % of fit) on rank 0
// at the end of fit and writes it to <log_dir>/profiler-fit.txt.
// "pytorch" records LibTorch's Kineto profiler (CPU ops, CUDA kernels with
// accelerator cuda) over training batches [wait, wait + active) of the fit
// (profiler_steps "wait:active", counted from the first batch of this Fit),
// with each phase above as a user range, and writes a Chrome trace per rank:
// <log_dir>/profiler-fit-rank<R>.pt.trace.json (chrome://tracing, Perfetto).
#ifndef SHARDTRAIN_TRAINER_PROFILERS_PROFILER_H_
#define SHARDTRAIN_TRAINER_PROFILERS_PROFILER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain::trainer {

// The phase names (the actions of the report and the trace's user ranges).
inline constexpr char kActionGetTrainBatch[] = "get_train_batch";
inline constexpr char kActionTrainingStep[] = "training_step";
inline constexpr char kActionBackward[] = "backward";
inline constexpr char kActionOptimizerStep[] = "optimizer_step";
inline constexpr char kActionValidation[] = "validation";
inline constexpr char kActionTest[] = "test";
inline constexpr char kActionSaveCheckpoint[] = "save_checkpoint";
inline constexpr char kActionOnTrainBatchEnd[] = "on_train_batch_end";
inline constexpr char kActionCallbacksOnTrainBatchEnd[] = "callbacks.on_train_batch_end";
inline constexpr char kActionOnTrainEpochEnd[] = "on_train_epoch_end";
inline constexpr char kActionCommunicationWait[] = "communication_wait";

// One row of the simple profiler's report.
struct ProfiledAction {
  std::string action;
  int64_t calls = 0;
  double total_s = 0;
  double mean_s() const { return calls > 0 ? total_s / static_cast<double>(calls) : 0.0; }
};

// What the fit loop reports to; created by MakeProfiler on the thread that runs Fit.
class Profiler {
 public:
  virtual ~Profiler() = default;
  // Start and end of one `action` (a string that outlives the profiler, e.g.
  // the constants above); End gets what Begin returned.
  virtual int64_t Begin(const char* action) = 0;
  virtual void End(const char* action, int64_t begin) = 0;
  // End of fit: writes the report or the trace (see the file comment).
  virtual void Report() = 0;
  // Stops measuring (without writing anything if Report did not run); Fit
  // calls it on every exit, on the thread that created the profiler.
  virtual void Close() = 0;
  // The simple profiler's rows, sorted by total time (empty for "pytorch"):
  // "fit" (the whole fit, 1 call) first.
  virtual std::vector<ProfiledAction> Summary() const { return {}; }
  // Files this profiler wrote (after Report).
  virtual std::vector<std::string> written() const = 0;
};

// Times one action while it lives, or until Stop(); inert with a null profiler.
class ProfileScope {
 public:
  ProfileScope(Profiler* profiler, const char* action) : profiler_(profiler), action_(action) {
    if (profiler_) begin_ = profiler_->Begin(action_);
  }
  ~ProfileScope() { Stop(); }
  ProfileScope(ProfileScope&& o) noexcept : profiler_(o.profiler_), action_(o.action_), begin_(o.begin_) {
    o.profiler_ = nullptr;
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;
  ProfileScope& operator=(ProfileScope&&) = delete;
  void Stop() {
    if (!profiler_) return;
    profiler_->End(action_, begin_);
    profiler_ = nullptr;
  }

 private:
  Profiler* profiler_;
  const char* action_;
  int64_t begin_ = 0;
};

// Checks TrainerOptions::profiler ("", "simple", "pytorch") and
// profiler_steps ("wait:active", wait >= 0, active >= 1); InvalidArgumentError
// naming the valid forms.
void CheckProfilerOptions(const std::string& profiler, const std::string& profiler_steps);
// TrainerOptions::profiler's values: "" (off), simple, pytorch.
const std::vector<std::string>& ProfilerNames();

// The profiler for `kind` ("" -> nullptr), writing under `dir` (rank `rank`
// of the job; the simple report only on rank 0). `cuda`: also trace CUDA.
std::unique_ptr<Profiler> MakeProfiler(const std::string& kind, const std::string& profiler_steps,
                                       const std::string& dir, int rank, bool cuda);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_PROFILERS_PROFILER_H_
