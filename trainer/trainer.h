// Trainer: the fit, validate, test and predict loops (Lightning's Trainer; docs/lightning.md maps the two).
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
// Checkpoints (trainer/checkpoint_io/checkpoint.h) go to <log_dir>/checkpoints/: last.ckpt at
// each epoch end and at the end of fit, and step=N.ckpt every
// checkpoint_every_n_steps — or, with a ModelCheckpoint callback
// (trainer/callbacks/model_checkpoint.h), where and when it says. A strategy that prefers
// sharded checkpoints (fsdp_native state_dict_type=sharded) writes them as
// directories with one file per rank (trainer/checkpoint_io/sharded_checkpoint.h).
// Fit(..., ckpt_path) resumes exactly where the checkpoint was taken (model,
// optimizer, loop position, CPU RNG state, callback states, the 16-mixed
// GradScaler), from a full file or a sharded directory, at the same or (for
// Adam, AdamW, SGD) another world size.
//
// Callbacks (TrainerOptions::callbacks) run at fixed points on every rank;
// loggers (CSV, TensorBoard) write on rank 0.
//
// Each optimizer step makes one all-reduce of scalars, with or without
// callbacks: the step's loss, what the module Log()ged (one more only at the
// step whose logged names change), the should-stop requests, the
// stop-signal flags, the 16-mixed overflow flag and whether the background
// writers of an asynchronous save (TrainerOptions::async_checkpoint) finished
// or failed travel in one tensor.
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
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "strategies/registry.h"
#include "strategies/strategy.h"
#include "trainer/callbacks/callback.h"
#include "trainer/callbacks/early_stopping.h"
#include "trainer/callbacks/learning_rate_monitor.h"
#include "trainer/callbacks/model_checkpoint.h"
#include "trainer/data/data.h"
#include "trainer/data/data_loader.h"
#include "trainer/data_module.h"
#include "trainer/loggers/logger.h"
#include "trainer/loops/nonfinite.h"
#include "trainer/optim/grad_scaler.h"
#include "trainer/plugins/accelerator.h"
#include "trainer/plugins/sync_batchnorm.h"
#include "trainer/profilers/profiler.h"
#include "trainer/trainer_options.h"
#include "trainer/training_module.h"

namespace shardtrain::trainer {

namespace internal {
class FitLoop;
class EvalLoop;
class LRStepping;
class ProcessConnector;
class LoggerConnector;
class CheckpointConnector;
class DataConnector;
class ProfilingConnector;
}  // namespace internal

class Trainer {
 public:
  // Validates the options (InvalidArgumentError listing valid values; an
  // unavailable accelerator says why). `world`: an already connected
  // communicator to use instead of launching.
  explicit Trainer(TrainerOptions options, comm::CommunicatorPtr world = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;  // its loops and connectors hold it by reference
  Trainer& operator=(const Trainer&) = delete;

  // Trains `module` on `train`; validates on `val` when given. `ckpt_path`:
  // resume from this checkpoint; "last": from the newest complete checkpoint
  // of the newest run under default_root_dir (InvalidArgumentError if none).
  // Throws Preempted (trainer/stop_signals.h) after a stop signal, once the
  // checkpoint is written.
  // When Fit throws (Preempted included), every rank that throws first runs
  // the module's and the callbacks' on_exception.
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

  // ---- DataModule (trainer/data_module.h; trainer/connectors/data_connector.cc) ----
  // Fit and Validate on the data sets of `datamodule`, as Lightning's
  // trainer.fit(model, datamodule=...): prepare_data() on local rank 0 of
  // each node (every rank waits for it; a failure there throws on every
  // rank), setup(stage) on every rank, the run on the stage's data sets
  // (Fit: train_dataset(), required, and val_dataset(), optional; Validate:
  // val_dataset(), required), then teardown(stage), also after an exception.
  void Fit(TrainingModule& module, DataModule& datamodule, const std::string& ckpt_path = "");
  double Validate(TrainingModule& module, DataModule& datamodule);
  // Test and Predict on test_dataset() / predict_dataset(), as above.
  std::map<std::string, double> Test(TrainingModule& module, DataModule& datamodule);
  at::Tensor Predict(TrainingModule& module, DataModule& datamodule, const PredictOptions& options = {});
  // ---- Test and Predict (trainer/loops/eval_loop.cc) ----
  // Lightning's trainer.test: one collective pass over `test` in
  // DistributedSampler order (no shuffling; val_batch_size, or batch_size,
  // samples per rank per batch), the model in eval mode without gradients,
  // with module.test_step. Samples a rank got as padding (when W does not
  // divide the set) are cut from its last batch (which may be left empty)
  // and never counted: test_loss
  // (the mean of what test_step returns) and what test_step log()s are means
  // over the test set's samples, each batch weighted by its real samples,
  // over all ranks (batch means in, sample means out). Hooks, the module's
  // before the callbacks': on_test_start, on_test_epoch_end (the metrics are
  // in callback_metrics() by then; a value the module log()s there joins
  // them, rank-averaged), on_test_end. The metrics are sent to the loggers at
  // the current global step and returned (test_loss, when test_step returned
  // losses, and every logged name). Uses the model of the last Fit, or sets
  // one up as Validate does. InvalidArgumentError for an empty set or a call
  // inside Fit.
  std::map<std::string, double> Test(TrainingModule& module, const Dataset& test);
  // Lightning's trainer.predict: one collective pass over `data` (order and
  // batches as Test; the model in eval mode without gradients) with
  // module.predict_step, whose outputs (one row per sample) are joined along
  // dimension 0: with options.gather (the default) every rank returns the
  // predictions of all samples in dataset order, each once (the sampler's
  // interleaving undone, padding duplicates dropped); see PredictOptions for
  // per-rank output. The result lives on the collective device (CPU with
  // Gloo, this rank's CUDA device with NCCL). Not logged; what predict_step
  // log()s is dropped. InvalidArgumentError for an empty set, a call inside
  // Fit, or predict_step outputs whose rows differ in shape or dtype
  // between batches or ranks.
  at::Tensor Predict(TrainingModule& module, const Dataset& data, const PredictOptions& options = {});

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
  // With TrainerOptions::async_checkpoint, a sharded save inside Fit returns
  // once the state is planned and completes in the background (the file is
  // complete, and last_checkpoint_path() names it, from the step after its
  // writers finished, at the next save, or at the end of Fit).
  void SaveCheckpoint(const std::string& path, CheckpointFormat format = CheckpointFormat::kAuto);
  // Runs `fn` on this rank once the save in flight is complete (at once when
  // none is); never if it fails. ModelCheckpoint deletes files it no longer
  // keeps so: a crash mid-save leaves the checkpoints before it.
  void WhenCheckpointSaved(std::function<void()> fn);
  // What the asynchronous saves cost (TrainerOptions::async_checkpoint).
  const AsyncCheckpointStats& async_checkpoint_stats() const { return async_checkpoint_stats_; }

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
  // The ranks that read distinct batches and this rank's index among them
  // (Strategy::data_parallel_size; the world until the strategy is set up).
  int data_parallel_rank() const;
  int data_parallel_size() const;
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
  // ---- Run controls (trainer/loops/run_controls.h) ----
  // True while Fit runs its sanity validation steps (num_sanity_val_steps).
  bool sanity_checking() const { return sanity_checking_; }

  // For callbacks. The latest rank-reduced metrics: train_loss (each
  // optimizer step), val_loss (each validation) and what the module log()s.
  const std::map<std::string, double>& callback_metrics() const { return callback_metrics_; }
  // Asks Fit to stop after the current optimizer step. The flag travels in
  // the step's one all-reduce and is all-reduced at validation ends and
  // epoch ends, so a request from any rank stops every rank at the same
  // point. A request made after the step's all-reduce (in on_train_batch_end,
  // as Lightning's callbacks do) stops after that same step too: it reaches
  // the other ranks with the next step's all-reduce, and that step is
  // dropped (no optimizer step, loop position kept; its micro-batches' hooks
  // did run).
  void set_should_stop(bool stop) { should_stop_ = stop; }
  bool should_stop() const { return should_stop_; }
  // Sends a row of scalars to every logger (rank 0; a no-op elsewhere).
  void LogMetrics(const std::map<std::string, double>& metrics, int64_t step);
  const std::vector<std::shared_ptr<Logger>>& loggers() const;
  const std::vector<CallbackPtr>& callbacks() const { return options_.callbacks; }
  // Current learning rate of each parameter group, and the optimizer's kind
  // ("Adam", "AdamW", "SGD", or "Optimizer").
  std::vector<double> learning_rates() const;
  std::string optimizer_name() const;
  torch::optim::Optimizer* optimizer() const { return opt_.optimizer.get(); }

  // ---- Profiling and SyncBatchNorm (trainer/profilers/profiler.cc, trainer/plugins/sync_batchnorm.cc) ----
  // The profiler of the current or last Fit (null when TrainerOptions::profiler is "").
  const Profiler* profiler() const;
  // The BatchNorm layers sync_batchnorm converted (null when off).
  const SyncBatchNormConversion* sync_batchnorm() const { return sync_bn_.get(); }
  // ---- Learning-rate schedulers (trainer/optim/lr_scheduler.h; trainer/loops/lr_stepping.cc) ----
  // Fit steps each LRSchedulerConfig of configure_optimizers: interval
  // "step" after every `frequency`-th optimizer step (global step %
  // frequency == 0, also for steps the 16-mixed scaler skipped), once the
  // step's metrics are in callback_metrics and logged ("lr" in the logged
  // row is the lr the step used), before the step's checkpoint; interval
  // "epoch" at the end of every `frequency`-th epoch, after the epoch's
  // validation, before on_train_epoch_end callbacks and last.ckpt. A
  // ReduceLROnPlateau gets callback_metrics()[monitor]; missing, it is an
  // InvalidArgumentError naming the metric and the available ones (strict)
  // or a skipped step with a warning. Checkpoints hold every scheduler's
  // state and the optimizer's lrs and momentums, so a resumed Fit continues
  // the schedule exactly. lr_lambda runs as a LambdaLR (interval "step").
  const std::vector<LRSchedulerConfig>& lr_scheduler_configs() const;
  // {name: lr} as LearningRateMonitor logs them, with Lightning's names: per
  // scheduler config its name or "lr-<Optimizer>" (further unnamed ones
  // "lr-<Optimizer>-1", "-2", ...), with "/pg<i>" (1-based) per parameter
  // group when there are several; without schedulers, the optimizer's.
  // `last_step`: the lrs the last optimizer step used (logged at its global
  // step with its loss, as Lightning pairs them), else the current ones
  // (after the schedulers stepped: the next step's).
  std::map<std::string, double> learning_rate_stats(bool last_step = false) const;
  // ---- Faults ----
  // Optimizer steps skipped by nonfinite = "skip" (this Trainer, every Fit).
  int64_t skipped_nonfinite_steps() const { return nonfinite_.skipped(); }
  // ---- end Faults ----

 private:
  // The loops and connectors (Lightning's split): each takes the Trainer by
  // reference and works on the state below; the Trainer owns one of each.
  friend class internal::FitLoop;              // trainer/loops/internal/fit_loop.h
  friend class internal::EvalLoop;             // trainer/loops/internal/eval_loop.h
  friend class internal::LRStepping;           // trainer/loops/internal/lr_stepping.h
  friend class internal::ProcessConnector;     // trainer/connectors/internal/process_connector.h
  friend class internal::LoggerConnector;      // trainer/connectors/internal/logger_connector.h
  friend class internal::CheckpointConnector;  // trainer/connectors/internal/checkpoint_connector.h
  friend class internal::DataConnector;        // trainer/connectors/internal/data_connector.h
  friend class internal::ProfilingConnector;   // trainer/connectors/internal/profiling_connector.h

  // The strategy, device, model and optimizer of `module`, once per Trainer.
  void SetupModel(TrainingModule& module);
  // A batch on this rank's device, floating inputs in the compute dtype.
  Batch ToDevice(Batch b) const;
  int64_t NumTrainingBatches(const Dataset& train, int world_size) const;
  // should_stop() agreed over the ranks (max; only when there are callbacks to ask).
  void SyncShouldStop();
  ProfileScope Profile(const char* action);

  std::unique_ptr<internal::ProcessConnector> process_connector_;
  std::unique_ptr<internal::LoggerConnector> logger_connector_;
  std::unique_ptr<internal::CheckpointConnector> checkpoint_connector_;
  std::unique_ptr<internal::DataConnector> data_connector_;
  std::unique_ptr<internal::ProfilingConnector> profiling_connector_;
  std::unique_ptr<internal::LRStepping> lr_stepping_;
  std::unique_ptr<internal::FitLoop> fit_loop_;
  std::unique_ptr<internal::EvalLoop> eval_loop_;

  // ---- Resolved options and processes ----
  TrainerOptions options_;
  std::string accelerator_;  // resolved: "cpu" or "cuda"
  int devices_ = 1;          // resolved ranks per node
  int64_t max_epochs_ = kDefaultMaxEpochs;  // resolved
  strategies::Precision precision_ = strategies::Precision::k32True;  // options_.precision, parsed once
  c10::Device device_{c10::kCPU};
  std::optional<ClusterInfo> cluster_;  // detected by SetupProcesses (none with an injected communicator)
  comm::CommunicatorPtr world_;
  // ---- Model and optimizer ----
  strategies::StrategyPtr strategy_;
  TrainingModule* module_ = nullptr;
  OptimizerConfig opt_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<SyncBatchNormConversion> sync_bn_;
  NonfiniteCheck nonfinite_;  // TrainerOptions::nonfinite (trainer/loops/nonfinite.cc)
  // ---- Loop state ----
  int64_t fit_train_batches_ = -1;  // per rank per epoch, of the current or last Fit
  // Fit's training set while SetupModel runs: once the strategy is set up
  // (and knows its data-parallel size) SetupModel counts its batches, before
  // configure_optimizers may ask for estimated_stepping_batches().
  const Dataset* fit_train_set_ = nullptr;
  bool fitting_ = false;
  bool sanity_checking_ = false;
  bool should_stop_ = false;
  int64_t epoch_ = 0;
  int64_t global_step_ = 0;
  int64_t batch_in_epoch_ = 0;
  std::map<std::string, double> callback_metrics_;
  std::vector<double> step_losses_;
  std::vector<double> val_losses_;
  // ---- Checkpoints ----
  std::string ckpt_dir_;
  std::string last_ckpt_;
  AsyncCheckpointStats async_checkpoint_stats_;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_TRAINER_H_
