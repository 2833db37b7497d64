// Trainer: the fit/validate loops (Lightning's Trainer).
//
//   TrainerOptions o;
//   o.strategy = "fsdp_native"; o.strategy_options = {{"sharding_strategy", "FULL_SHARD"}};
//   o.devices = 2; o.max_epochs = 3;
//   Trainer trainer(o);
//   trainer.Fit(module, train_set, &val_set);
//   return shardtrain::JoinLocalRanks(0);   // end of main(): waits for the ranks the
//                                           // Trainer launched (#include "launch/launcher.h",
//                                           // Bazel target //launch:launcher)
//
// Processes: with an injected communicator (threads-as-ranks tests, or a
// program that made its own) the Trainer uses it. Otherwise, for
// devices * num_nodes > 1, a process not started by a launcher re-executes its
// own binary for the other local ranks (launch/launcher.h LaunchLocalRanks), then
// every rank detects its place (launch/cluster_environment.h: torchrun, SLURM,
// MPI variables), meets the others through a TCPStore and talks Gloo — or,
// with accelerator cuda, NCCL, each rank on cuda:<local rank>.
//
// Loop: per epoch a DistributedSampler gives each rank its share (reshuffled
// with seed + epoch); every rank runs the same number of batches.
// accumulate_grad_batches micro-batches make one optimizer step (the first
// ones without gradient synchronization); gradients are clipped after
// synchronization (and, with "16-mixed", after the GradScaler unscaled them;
// a step that overflowed on any rank is skipped on all); the loss is logged
// as the rank- and micro-batch mean.
// Checkpoints (trainer/checkpoint.h) go to <log_dir>/checkpoints/: last.ckpt at
// each epoch end and at the end of fit, and step=N.ckpt every
// checkpoint_every_n_steps — or, with a ModelCheckpoint callback
// (trainer/callbacks.h), where and when it says. A strategy that prefers
// sharded checkpoints (fsdp_native state_dict_type=sharded) writes them as
// directories with one file per rank (trainer/sharded_checkpoint.h).
// Fit(..., ckpt_path) resumes exactly where the checkpoint was taken (model,
// optimizer, loop position, CPU RNG state, callback states, the 16-mixed
// GradScaler), from a full file or a sharded directory, at the same or (for
// Adam, AdamW, SGD) another world size.
//
// Callbacks (TrainerOptions::callbacks) run at fixed points on every rank;
// loggers (CSV, TensorBoard) write on rank 0.
//
// Each optimizer step makes one all-reduce of scalars (more only with
// callbacks: see set_should_stop): the step's loss, what training_step
// log()ged, the should-stop request, the stop-signal flags and the 16-mixed
// overflow flag travel in one tensor.
//
// Preemption (trainer/stop_signals.h): SIGTERM, SIGINT or SIGUSR1 on any rank
// or on the launcher make every rank finish the current optimizer step, then
// the checkpoint is written (<checkpoint_dir>/last.ckpt) and Fit throws
// Preempted on every rank (exit status 128 + signal). Resume with
// ckpt_path="last" or TrainerOptions::resume="auto".
#ifndef SHARDTRAIN_TRAINER_TRAINER_H_
#define SHARDTRAIN_TRAINER_TRAINER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "strategies/registry.h"
#include "strategies/strategy.h"
#include "trainer/accelerator.h"
#include "trainer/callbacks.h"
#include "trainer/data.h"
#include "trainer/grad_scaler.h"
#include "trainer/logger.h"
#include "trainer/nonfinite.h"
#include "trainer/training_module.h"

namespace shardtrain::trainer {

// What Trainer::SaveCheckpoint writes.
enum class CheckpointFormat {
  kAuto,     // sharded if the strategy prefers it (fsdp_native state_dict_type=sharded), else full
  kFull,     // one file written by rank 0 (trainer/checkpoint.h)
  kSharded,  // a directory, one file per rank (trainer/sharded_checkpoint.h); sharded strategies only
};

// max_epochs when neither max_epochs nor max_steps is given (Lightning's).
inline constexpr int64_t kDefaultMaxEpochs = 1000;

struct TrainerOptions {
  // "cpu", "cuda" (alias "gpu": one rank per CUDA device, cuda:<local rank>,
  // model and batches moved there, NCCL between ranks; needs a build with
  // --config=cuda and a visible device), or "auto" (cuda when both hold, else
  // cpu). Checked at construction (trainer/accelerator.h).
  std::string accelerator = "auto";
  // Ranks per node; kAutoDevices (trainer/accelerator.h) is Lightning's
  // devices="auto": every visible CUDA device with cuda, 1 on cpu.
  int devices = 1;
  int num_nodes = 1;
  // Strategy by registered name ("auto": ddp when several ranks, else
  // single_device) with string options, or an object (wins when set).
  std::string strategy = "auto";
  strategies::StrategyOptions strategy_options;
  strategies::StrategyPtr strategy_object;
  std::string precision = "32-true";  // "32-true", "bf16-mixed", "16-mixed", "bf16-true"
  // Dynamic loss scaling for "16-mixed" (trainer/grad_scaler.h): the loss is
  // scaled before backward, gradients are unscaled before clipping, steps
  // whose gradients overflow on any rank are skipped on every rank (the
  // optimizer does not step; global_step and the LR schedule still advance,
  // as in Lightning) and the scale backs off. Unused by other precisions.
  GradScalerOptions grad_scaler;
  // Epochs to train; -1: unlimited (needs max_steps). Unset, as Lightning's
  // max_epochs=None: kDefaultMaxEpochs (1000) when max_steps is -1, else
  // unlimited (max_steps alone decides).
  std::optional<int64_t> max_epochs;
  int64_t max_steps = -1;             // optimizer steps; -1: no limit
  int64_t accumulate_grad_batches = 1;
  double gradient_clip_val = 0;       // 0: no clipping
  std::string gradient_clip_algorithm = "norm";  // "norm" or "value"
  // When to validate during Fit, counted in training batches (micro-batches,
  // per rank; equal to optimizer steps when accumulate_grad_batches is 1),
  // within each epoch (the count restarts every epoch), as Lightning:
  //   in (0, 1]  a fraction of the epoch's batches: validate after every
  //              floor(fraction * batches) of them (1.0, the default: once,
  //              at the end of each epoch; 0.25: four times per epoch);
  //   > 1        every N training batches (Lightning's int N; 1 training
  //              batch has no spelling here: use 1.0 / batches per epoch).
  // Validation metrics are logged at the global step at which it ran.
  double val_check_interval = 1.0;
  // <= 1.0: fraction of the batches; > 1: number of batches (per epoch, per rank).
  double limit_train_batches = 1.0;
  double limit_val_batches = 1.0;
  int64_t log_every_n_steps = 50;
  std::string default_root_dir = ".";
  std::string logger_name = "lightning_logs";
  bool enable_checkpointing = true;
  int64_t checkpoint_every_n_steps = 0;  // 0: only at epoch ends and the end of fit
  bool enable_progress_bar = true;
  bool enable_logger = true;
  // Loggers by name when enable_logger: "csv" (CsvLogger) and/or
  // "tensorboard" (TensorBoardLogger); they share one version_N directory.
  std::vector<std::string> loggers = {"csv"};
  // Further loggers (used on rank 0, after the named ones).
  std::vector<std::shared_ptr<Logger>> logger_objects;
  // Run in this order at each hook (trainer/callbacks.h). A ModelCheckpoint
  // here replaces the built-in checkpointing (last.ckpt, checkpoint_every_n_steps).
  std::vector<CallbackPtr> callbacks;
  uint64_t seed = 0;
  bool deterministic = false;
  // The data loader part (Lightning keeps it in the DataLoader).
  int64_t batch_size = 8;      // per rank
  int64_t val_batch_size = 0;  // 0: batch_size
  bool shuffle = true;
  bool drop_last = false;      // drop the last partial batch; ranks are always padded to equal shares
  // "never", or "auto": a Fit given no ckpt_path resumes from the newest
  // complete checkpoint under default_root_dir when there is one
  // (FindLatestCheckpoint in trainer/resume.h; as ckpt_path="last"), and
  // starts afresh when there is none: a requeued SLURM job or a torchrun
  // --max-restarts restart continues with the same command line.
  std::string resume = "never";
  // Limit on every collective and on the rendezvous (meeting the other
  // ranks) of a Trainer that makes its own processes; PyTorch's default.
  // Must be > 0. (An injected communicator keeps its own.)
  std::chrono::milliseconds timeout = std::chrono::minutes(30);

  // ---- Faults (#12): non-finite values, stalled peers ----
  // A step whose loss or a gradient is NaN/Inf on any rank: "off" (trains
  // on), "error" (every rank throws NonfiniteError naming the step and, on
  // the rank that found it, the loss or the first parameter), "skip" (every
  // rank skips that optimizer step; counted). See trainer/nonfinite.h.
  std::string nonfinite = "off";
  // If > 0: a collective blocked this long on a peer that makes no progress
  // (its heartbeat stopped: hung or SIGSTOPped) fails on every waiting rank
  // naming that peer, long before `timeout` (GlooOptions::stall_timeout;
  // heartbeats every second). 0: only `timeout` ends a wait. Gloo ranks of
  // a Trainer that makes its own processes.
  std::chrono::milliseconds stall_timeout{0};
  // ---- end Faults ----
};

class Trainer {
 public:
  // Validates the options (InvalidArgumentError listing valid values; an
  // unavailable accelerator says why). `world`: an already connected
  // communicator to use instead of launching.
  explicit Trainer(TrainerOptions options, comm::CommunicatorPtr world = nullptr);
  ~Trainer();

  // Trains `module` on `train`; validates on `val` when given. `ckpt_path`:
  // resume from this checkpoint; "last": from the newest complete checkpoint
  // of the newest run under default_root_dir (InvalidArgumentError if none).
  // Throws Preempted (trainer/stop_signals.h) after a stop signal, once the
  // checkpoint is written.
  void Fit(TrainingModule& module, const Dataset& train, const Dataset* val = nullptr,
           const std::string& ckpt_path = "");
  // Lightning's trainer.validate: one validation pass (collective) with the
  // validation hooks of the module and the callbacks (on_validation_start,
  // on_validation_end; fitting() is false, so EarlyStopping does not act),
  // its metrics (val_loss and what validation_step log()s, averaged over
  // batches and ranks) in callback_metrics() and sent to the loggers at the
  // current global step. Returns the mean val_loss (NaN if validation_step
  // returns nothing). Uses the model of the last Fit, or sets one up.
  double Validate(TrainingModule& module, const Dataset& val);

  // Lightning's estimated_stepping_batches: the optimizer steps a Fit on
  // `train` takes from its start — ceil(batches per rank per epoch, after
  // limit_train_batches, / accumulate_grad_batches) * max(max_epochs, 1),
  // capped by max_steps; max_steps when max_epochs is -1 (or unset with max_steps).
  // Without an argument: for the training data of the current or last Fit
  // (valid from configure_optimizers on, e.g. for a one-cycle schedule;
  // InvalidArgumentError before).
  int64_t estimated_stepping_batches(const Dataset& train) const;
  int64_t estimated_stepping_batches() const;

  // Writes a checkpoint (collective: every rank must call): full, or sharded
  // when the strategy prefers it (kAuto). Atomic; on failure every rank throws
  // shardtrain::Error and the previous file or directory at `path` is intact.
  void SaveCheckpoint(const std::string& path, CheckpointFormat format = CheckpointFormat::kAuto);

  const TrainerOptions& options() const { return options_; }
  // The epoch limit in effect: options().max_epochs, or what an unset one
  // means (kDefaultMaxEpochs, or -1 = unlimited when max_steps is given).
  int64_t max_epochs() const { return max_epochs_; }
  // The resolved accelerator ("cpu" or "cuda") and ranks per node.
  const std::string& accelerator() const { return accelerator_; }
  int devices() const { return devices_; }
  // This rank's device (cuda:<local rank> or cpu); set up by Fit/Validate.
  const c10::Device& device() const { return device_; }
  // True inside Fit, false inside a standalone Validate (Lightning's
  // trainer.state.fn == "fit").
  bool fitting() const { return fitting_; }
  // The loss scaler of a "16-mixed" run (null otherwise, or before Fit).
  const GradScaler* grad_scaler() const { return scaler_.get(); }
  strategies::Strategy& strategy();
  int rank() const;
  int world_size() const;
  int64_t global_step() const { return global_step_; }
  int64_t current_epoch() const { return epoch_; }
  // Global (rank- and micro-batch-averaged) loss of every optimizer step of the last Fit.
  const std::vector<double>& step_losses() const { return step_losses_; }
  const std::vector<double>& val_losses() const { return val_losses_; }
  // <root>/<logger_name>/version_N on rank 0 ("" before Fit or without logger).
  std::string log_dir() const;
  std::string last_checkpoint_path() const { return last_ckpt_; }
  // Where checkpoints go by default (<log_dir>/checkpoints, or
  // <default_root_dir>/checkpoints without logger); set by Fit.
  const std::string& checkpoint_dir() const { return ckpt_dir_; }

  // For callbacks. The latest rank-reduced metrics: train_loss (each
  // optimizer step), val_loss (each validation) and what the module log()s.
  const std::map<std::string, double>& callback_metrics() const { return callback_metrics_; }
  // Asks Fit to stop after the current optimizer step. The flag is
  // all-reduced at step ends, validation ends and epoch ends, so a request
  // from any rank stops every rank at the same point. (A request made in
  // on_train_batch_end must stop the same step, as in Lightning: with
  // callbacks, each step makes a second one-scalar all-reduce after them.)
  void set_should_stop(bool stop) { should_stop_ = stop; }
  bool should_stop() const { return should_stop_; }
  // Sends a row of scalars to every logger (rank 0; a no-op elsewhere).
  void LogMetrics(const std::map<std::string, double>& metrics, int64_t step);
  const std::vector<std::shared_ptr<Logger>>& loggers() const { return loggers_; }
  const std::vector<CallbackPtr>& callbacks() const { return options_.callbacks; }
  // Current learning rate of each parameter group, and the optimizer's kind
  // ("Adam", "AdamW", "SGD", or "Optimizer").
  std::vector<double> learning_rates() const;
  std::string optimizer_name() const;
  torch::optim::Optimizer* optimizer() const { return opt_.optimizer.get(); }

  // ---- Faults (#12) ----
  // Optimizer steps skipped by nonfinite = "skip" (this Trainer, every Fit).
  int64_t skipped_nonfinite_steps() const { return nonfinite_.skipped(); }
  // ---- end Faults ----

 private:
  void SetupProcesses();
  void SetupModel(TrainingModule& module);
  // Loggers (rank 0) and the checkpoint directory (every rank), once per Trainer.
  void SetupLoggers(TrainingModule& module);
  Batch ToDevice(Batch b) const;
  int64_t NumTrainingBatches(const Dataset& train, int world_size) const;
  void LoadFrom(const std::string& path);
  double RunValidation(TrainingModule& module, const Dataset& val);
  int64_t LimitBatches(double limit, int64_t available) const;
  std::vector<std::string> GatherOptimizerStates();
  void SaveFull(const std::string& path);
  void SaveSharded(const std::string& path);
  // Throws on every rank when `failed` on any (with this rank's message if it failed).
  void AgreeOrThrow(bool failed, const std::string& message, const std::string& what);
  void SyncShouldStop();
  // Fit's steps, in the order Lightning's fit loop runs them (trainer.cc).
  struct FitLoop;
  std::string ResolveCheckpointPath(const std::string& ckpt_path);
  void RunEpoch(FitLoop& loop);
  at::Tensor TrainStep(FitLoop& loop, const std::vector<int64_t>& batch, int64_t i);
  double SyncStep(FitLoop& loop, double overflow);
  void OptimizerStep(FitLoop& loop, bool skip);
  void OnStepEnd(FitLoop& loop);
  void OnEpochEnd(FitLoop& loop);
  void FinishFit(FitLoop& loop);
  std::string SaveLast(FitLoop& loop);
  std::vector<double> AllReduceSum(std::vector<double> values);
  std::string BroadcastString(const std::string& s);
  std::map<std::string, std::map<std::string, std::string>> CallbackStates() const;

  TrainerOptions options_;
  std::string accelerator_;  // resolved: "cpu" or "cuda"
  int devices_ = 1;          // resolved ranks per node
  int64_t max_epochs_ = kDefaultMaxEpochs;  // resolved
  c10::Device device_{c10::kCPU};
  std::optional<ClusterInfo> cluster_;  // detected by SetupProcesses (none with an injected communicator)
  comm::CommunicatorPtr world_;
  strategies::StrategyPtr strategy_;
  TrainingModule* module_ = nullptr;
  OptimizerConfig opt_;
  std::vector<double> initial_lrs_;
  std::vector<std::shared_ptr<Logger>> loggers_;
  bool loggers_set_up_ = false;
  std::unique_ptr<GradScaler> scaler_;
  int64_t fit_train_batches_ = -1;  // per rank per epoch, of the current or last Fit
  bool fitting_ = false;
  std::map<std::string, double> callback_metrics_;
  bool should_stop_ = false;
  std::string ckpt_dir_;
  std::string last_ckpt_;
  int64_t epoch_ = 0;
  int64_t global_step_ = 0;
  int64_t batch_in_epoch_ = 0;
  std::vector<double> step_losses_;
  std::vector<double> val_losses_;

  // ---- Faults (#12) ----
  NonfiniteCheck nonfinite_;  // TrainerOptions::nonfinite (trainer/nonfinite.cc)
  // ---- end Faults ----
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_TRAINER_H_
