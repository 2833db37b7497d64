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
// Each optimizer step makes one all-reduce of scalars, with or without
// callbacks: the step's loss, what the module Log()ged (one more only at the
// step whose logged names change), the should-stop requests, the
// stop-signal flags and the 16-mixed overflow flag travel in one tensor.
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
#include "trainer/accelerator.h"
#include "trainer/callbacks.h"
#include "trainer/data.h"
#include "trainer/data_loader.h"
#include "trainer/data_module.h"
#include "trainer/grad_scaler.h"
#include "trainer/logger.h"
#include "trainer/profiler.h"
#include "trainer/sync_batchnorm.h"
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
  // Build the model shard by shard inside configure_model (Lightning's
  // init_module(empty_init=True)): set, it overrides the strategy's own
  // sharded_construction option; unset, the strategy decides. true needs a
  // sharded strategy (fsdp, fsdp_native); see strategies/sharded_strategy_base.h.
  std::optional<bool> sharded_construction;
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
  // Sampler shuffling and the CPU RNG before configure_model; 0 (not given):
  // the seed of the last SeedEverything (trainer/run_controls.h), if any.
  uint64_t seed = 0;
  // Deterministic algorithms only (at::globalContext); an operation without
  // one fails Fit with an error that names it (trainer/run_controls.h).
  bool deterministic = false;
  // The data loader part (Lightning keeps it in the DataLoader).
  int64_t batch_size = 8;      // per rank
  int64_t val_batch_size = 0;  // 0: batch_size
  bool shuffle = true;
  bool drop_last = false;      // drop the last partial batch; ranks are always padded to equal shares
  // ---- Background loading (data) ----
  // Threads per rank that prepare the training and validation batches ahead
  // of the step (trainer/data_loader.h), in the sampler's order: the same
  // batches, hence the same losses, at any value; 0: on the training thread.
  // With > 0 the Dataset's get_batch runs on several threads at once.
  // In [0, kMaxDataLoaderWorkers].
  int num_workers = 0;
  // Batches prepared ahead per worker (>= 1; at most num_workers *
  // prefetch_factor wait at a time). Unused when num_workers is 0.
  int prefetch_factor = 2;
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

  // ---- Run controls (trainer/run_controls.h, trainer/model_summary.h) ----
  // Lightning's fast_dev_run: 0 off; N > 0 (true = 1) runs N training and N
  // validation batches (and N test/predict batches) once to find bugs:
  // max_epochs 1, max_steps N, no sanity check, no loggers, no checkpoints
  // (ModelCheckpoint, EarlyStopping and LearningRateMonitor callbacks are
  // dropped). options() shows the options in effect.
  int64_t fast_dev_run = 0;
  // Validation batches run before the first training batch of Fit (when a
  // validation set is given) to catch bugs in validation_step early; their
  // results and log() calls are discarded. -1: all (limited) validation batches; 0: off.
  int64_t num_sanity_val_steps = 2;
  // Validate (as val_check_interval says) only in every N-th epoch (N >= 1).
  int64_t check_val_every_n_epoch = 1;
  // Overfit a few batches: 0 off; in (0, 1) a fraction of the training
  // batches, >= 1 a count (1: one batch). Training runs on the first batches
  // without shuffling, and validation (when a validation set is given) on the
  // same batches of the training set.
  double overfit_batches = 0;
  // As limit_val_batches, for Test and Predict (LimitBatches in trainer/run_controls.h).
  double limit_test_batches = 1.0;
  double limit_predict_batches = 1.0;
  // At the start of Fit rank 0 prints a table of the model's units:
  // parameters, trainable, shard elements and bytes per rank (trainer/model_summary.h).
  bool enable_model_summary = true;

  // ---- Profiling and SyncBatchNorm (trainer/profiler.h, trainer/sync_batchnorm.h) ----
  // Lightning's profiler names: "" (off: costs one null check per phase),
  // "simple" (time per phase and hook and the communication wait: a table on
  // rank 0 at the end of Fit, also in <log_dir>/profiler-fit.txt), "pytorch"
  // (LibTorch's Kineto profiler: a Chrome trace per rank in
  // <log_dir>/profiler-fit-rank<R>.pt.trace.json).
  std::string profiler;
  // "pytorch": "wait:active": skip `wait` training batches of the Fit, trace the next `active`.
  std::string profiler_steps = "1:3";
  // Replaces every BatchNorm1d/2d/3d of the model (after configure_model,
  // before the strategy wraps it) by a SyncBatchNorm: statistics over the
  // global batch of all ranks (trainer/sync_batchnorm.h: the model must call
  // its BatchNorm through the module tree, ForwardBatchNorm).
  bool sync_batchnorm = false;

  // ---- Faults: non-finite values, stalled peers ----
  // A step whose loss or a gradient is NaN/Inf on any rank: "off" (trains
  // on), "error" (every rank throws NonfiniteError naming the step and, on
  // the rank that found it, the loss or the first parameter), "skip" (every
  // rank skips that optimizer step; counted). See trainer/nonfinite.h.
  std::string nonfinite = "off";
  // While a rank waits in a collective, it reads its peers' heartbeats (every
  // second) and, after `stall_warning` of no progress by a peer (its
  // heartbeat stopped: hung or SIGSTOPped; or alive but not issuing the
  // collective), logs a warning naming that peer (rank, pid, host, its last
  // collective), once per stall. 0: no warning. >= 0. (Gloo and NCCL
  // communicators of a Trainer that makes its own; GlooOptions/NcclOptions::
  // stall_warning; docs/reliability.md "Hangs".)
  std::chrono::milliseconds stall_warning = std::chrono::seconds(60);
  // If > 0: a collective blocked this long on a peer that makes no progress
  // fails on every waiting rank naming that peer, long before `timeout`
  // (GlooOptions/NcclOptions::stall_timeout). 0: only `timeout` ends a wait.
  // >= 0; may be below stall_warning (the failure then carries the report
  // the warning would have given).
  std::chrono::milliseconds stall_timeout{0};
  // ---- end Faults ----
};

// ---- Predict's options (trainer/eval_loop.cc) ----
struct PredictOptions {
  // true: every rank returns every sample's prediction, in dataset order
  // (one all-gather: W times a rank's share in memory on every rank).
  // false: no communication; each rank returns its own share, samples
  // rank, rank + W, rank + 2W, ... < dataset size (the DistributedSampler's
  // order without shuffling, padding duplicates dropped): for outputs too
  // large to hold W times, e.g. to write one file per rank.
  bool gather = true;
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

  // ---- DataModule (trainer/data_module.h; data_module.cc) ----
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
  // ---- Test and Predict (trainer/eval_loop.cc) ----
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
  // ---- Run controls (trainer/run_controls.h) ----
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
  const std::vector<std::shared_ptr<Logger>>& loggers() const { return loggers_; }
  const std::vector<CallbackPtr>& callbacks() const { return options_.callbacks; }
  // Current learning rate of each parameter group, and the optimizer's kind
  // ("Adam", "AdamW", "SGD", or "Optimizer").
  std::vector<double> learning_rates() const;
  std::string optimizer_name() const;
  torch::optim::Optimizer* optimizer() const { return opt_.optimizer.get(); }

  // ---- Profiling and SyncBatchNorm (trainer/profiler.cc, trainer/sync_batchnorm.cc) ----
  // The profiler of the current or last Fit (null when TrainerOptions::profiler is "").
  const Profiler* profiler() const { return profiler_.get(); }
  // The BatchNorm layers sync_batchnorm converted (null when off).
  const SyncBatchNormConversion* sync_batchnorm() const { return sync_bn_.get(); }
  // ---- Learning-rate schedulers (trainer/lr_scheduler.h; trainer/lr_scheduler_steps.cc) ----
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
  const std::vector<LRSchedulerConfig>& lr_scheduler_configs() const { return lr_schedulers_; }
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
  at::Tensor TrainStep(FitLoop& loop, Batch batch, int64_t i);
  double SyncStep(FitLoop& loop, double overflow);
  void OptimizerStep(FitLoop& loop, bool skip);
  void OnStepEnd(FitLoop& loop);
  // ---- logging, hooks (fit_loop.cc) ----
  void RunFit(TrainingModule& module, const Dataset& train, const Dataset* val, const std::string& ckpt_path);
  void DiscardStep(FitLoop& loop);
  void OnEpochEnd(FitLoop& loop);
  void FinishFit(FitLoop& loop);
  std::string SaveLast(FitLoop& loop);
  std::vector<double> AllReduceSum(std::vector<double> values);
  std::string BroadcastString(const std::string& s);
  // The callbacks' state_dict()s and (under kExtraStateKey) what the
  // on_save_checkpoint hooks write.
  std::map<std::string, std::map<std::string, std::string>> CallbackStates();
  // ---- Run controls (trainer/run_controls.cc) ----
  // num_sanity_val_steps validation batches, results and logs discarded.
  void RunSanityCheck(TrainingModule& module, const Dataset& val);
  // ---- Learning-rate schedulers (trainer/lr_scheduler_steps.cc) ----
  // Checks the configs of configure_optimizers (one optimizer, valid
  // intervals) and adds lr_lambda as a LambdaLR.
  void SetupLRSchedulers();
  // Steps the configs of `interval` due at `count` (global step, or epochs finished).
  void StepLRSchedulers(const std::string& interval, int64_t count);
  // Each config's state_dict() plus the optimizer's lrs and momentums.
  std::vector<SchedulerState> LRSchedulerStates() const;
  // Checks a checkpoint's scheduler states against this run's (throws naming
  // `path`, changing nothing) and returns what installs them.
  std::function<void()> PrepareLRSchedulerLoad(const std::vector<SchedulerState>& states, int64_t global_step,
                                               const std::string& path);
  // ---- data (data_module.cc) ----
  // The loader options of TrainerOptions (num_workers, prefetch_factor).
  DataLoaderOptions LoaderOptions() const;
  // prepare_data (see Fit(module, datamodule)), setup(stage), `run`, then
  // teardown(stage) (also when `run` throws). For each stage's overload
  // (Test/Predict: RunStage(dm, Stage::kTest, [&] { ... StageDataset(dm, Stage::kTest) ... })).
  void RunStage(DataModule& datamodule, Stage stage, const std::function<void()>& run);
  // The stage's required data set after setup (Fit: train_dataset(), Validate:
  // val_dataset(), ...); InvalidArgumentError naming the accessor when null.
  const Dataset& StageDataset(DataModule& datamodule, Stage stage);
  // This rank's index on its node.
  int LocalRank() const;

  // ---- The evaluation loop of validation, Test and Predict (trainer/eval_loop.cc) ----
  enum class EvalStage { kValidation, kTest };
  // One validation or test pass with its hooks; returns the metrics row
  // (the loss and what the module log()ged, reduced over batches and ranks).
  std::map<std::string, double> RunEvalStage(TrainingModule& module, const Dataset& data, EvalStage stage);
  // The epoch-end hooks of a validation or test pass (eval_loop.cc).
  void RunEvalEpochEnd(TrainingModule& module, bool test, std::map<std::string, double>& row);
  // Calls fn(batch, batch_idx, real) for this rank's batches of `data`
  // (as many as LimitBatches(options(), stage) allows), the model in eval mode under
  // NoGradGuard; `real`: the batch's samples that are not padding
  // duplicates. With trim_padding the duplicates are cut from the batch (it
  // may be left empty: it still runs, since the forward is collective).
  // fn returns false to stop.
  void ForEachEvalBatch(const Dataset& data, Stage stage, bool trim_padding,
                        const std::function<bool(const Batch&, int64_t, int64_t)>& fn);
  // Processes and model for Test/Predict (`what`), after checking the call
  // (not inside Fit) and the data (not empty).
  void SetupForEval(TrainingModule& module, const char* what, const Dataset& data);

  TrainerOptions options_;
  std::string accelerator_;  // resolved: "cpu" or "cuda"
  int devices_ = 1;          // resolved ranks per node
  int64_t max_epochs_ = kDefaultMaxEpochs;  // resolved
  c10::Device device_{c10::kCPU};
  std::optional<ClusterInfo> cluster_;  // detected by SetupProcesses (none with an injected communicator)
  comm::CommunicatorPtr world_;
  strategies::StrategyPtr strategy_;
  strategies::Precision precision_ = strategies::Precision::k32True;  // options_.precision, parsed once
  TrainingModule* module_ = nullptr;
  OptimizerConfig opt_;
  std::vector<double> initial_lrs_;
  // ---- Learning-rate schedulers ----
  std::vector<LRSchedulerConfig> lr_schedulers_;
  int lr_lambda_index_ = -1;  // the config made from lr_lambda
  bool lr_monitor_warned_ = false;
  std::vector<double> last_step_lrs_;  // the lrs the last optimizer step used
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
  // ---- Run controls ----
  bool sanity_checking_ = false;

  // ---- Profiling and SyncBatchNorm (trainer/profiler.cc, trainer/sync_batchnorm.cc) ----
  // Times `action` while the returned scope lives (inert when profiling is off).
  ProfileScope Profile(const char* action) { return ProfileScope(profiler_.get(), action); }
  // Held by Fit: makes the profiler (after the loggers: it writes to their
  // directory) and closes it on every exit; FinishFit calls Report().
  struct ProfilingScope {
    explicit ProfilingScope(Trainer& t);
    ~ProfilingScope();
    Trainer& trainer;
  };
  std::unique_ptr<Profiler> profiler_;
  std::unique_ptr<SyncBatchNormConversion> sync_bn_;

  // ---- Faults ----
  NonfiniteCheck nonfinite_;  // TrainerOptions::nonfinite (trainer/nonfinite.cc)
  // ---- end Faults ----
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_TRAINER_H_
