// TrainerOptions: what a Trainer is built with (Lightning's Trainer(...) arguments,
// with their names), in groups: hardware and strategy, the loop, data loading,
// logging and checkpointing, run controls, profiling, faults. PredictOptions and
// CheckpointFormat for the calls that take them. trainer/trainer.h includes this.
#ifndef SHARDTRAIN_TRAINER_TRAINER_OPTIONS_H_
#define SHARDTRAIN_TRAINER_TRAINER_OPTIONS_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strategies/registry.h"
#include "trainer/callbacks/callback.h"
#include "trainer/loggers/logger.h"
#include "trainer/optim/grad_scaler.h"

namespace shardtrain::trainer {

// What Trainer::SaveCheckpoint writes.
enum class CheckpointFormat {
  kAuto,     // sharded if the strategy prefers it (fsdp_native state_dict_type=sharded), else full
  kFull,     // one file written by rank 0 (trainer/checkpoint_io/checkpoint.h)
  kSharded,  // a directory, one file per rank (trainer/checkpoint_io/sharded_checkpoint.h); sharded strategies only
};

// max_epochs when neither max_epochs nor max_steps is given (Lightning's).
inline constexpr int64_t kDefaultMaxEpochs = 1000;

// What the asynchronous saves of a Trainer cost (Trainer::async_checkpoint_stats()).
struct AsyncCheckpointStats {
  std::string path;              // the last one ("" before the first)
  int64_t saves = 0;             // asynchronous saves completed
  double write_seconds = 0;      // the last one's slowest background writer
  int64_t units = 0;             // unit shards written, over the ranks and saves
  int64_t units_copied = 0;      // of which copied aside before the optimizer changed them
  int64_t peak_extra_bytes = 0;  // the most one rank held aside at once, over the saves
  double wait_seconds = 0;       // the optimizer's waits for the writer, slowest rank, over the saves
  int64_t budget_bytes = 0;      // the most one rank could hold aside (async_checkpoint_max_extra_memory)
};

struct TrainerOptions {
  // ---- Hardware, strategy, precision ----
  // "cpu", "cuda" (alias "gpu": one rank per CUDA device, cuda:<local rank>,
  // model and batches moved there, NCCL between ranks; needs a build with
  // --config=cuda and a visible device), or "auto" (cuda when both hold, else
  // cpu). Checked at construction (trainer/plugins/accelerator.h).
  std::string accelerator = "auto";
  // Ranks per node; kAutoDevices (trainer/plugins/accelerator.h) is Lightning's
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
  // Dynamic loss scaling for "16-mixed" (trainer/optim/grad_scaler.h): the loss is
  // scaled before backward, gradients are unscaled before clipping, steps
  // whose gradients overflow on any rank are skipped on every rank (the
  // optimizer does not step; global_step and the LR schedule still advance,
  // as in Lightning) and the scale backs off. Unused by other precisions.
  GradScalerOptions grad_scaler;
  // ---- The loop: length, accumulation, clipping, validation ----
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
  // ---- Logging, checkpointing, callbacks ----
  int64_t log_every_n_steps = 50;
  std::string default_root_dir = ".";
  std::string logger_name = "lightning_logs";
  bool enable_checkpointing = true;
  int64_t checkpoint_every_n_steps = 0;  // 0: only at epoch ends and the end of fit
  // Sharded saves inside Fit are written by a background thread per rank
  // while training goes on (Lightning's AsyncCheckpointIO, DCP's
  // async_save): the checkpoint is the state at the step where the save
  // began; the optimizer steps the units the writer has written first, then
  // copies aside units it has not reached (within
  // async_checkpoint_max_extra_memory), then waits for the writer
  // (trainer/connectors/internal/async_save.h).
  // At most one save is in flight (the next waits); the end of Fit and
  // preemption wait for it; a writer's failure stops Fit at the next step on
  // every rank. Full checkpoints stay synchronous (they gather every unit
  // through rank 0), as do saves outside Fit. docs/checkpoints.md.
  bool async_checkpoint = false;
  // The most a background save holds aside at once on a rank, as a fraction
  // of the bytes the rank writes (its shards and optimizer state), in
  // [0, 1]: 0 never copies (the optimizer waits for the writer), 1 may copy
  // everything (as DCP's async_save stages all). More spares a slow disk's
  // waits; a unit larger than this is waited for, never copied.
  double async_checkpoint_max_extra_memory = 0.2;
  bool enable_progress_bar = true;
  bool enable_logger = true;
  // Loggers by name when enable_logger: "csv" (CsvLogger) and/or
  // "tensorboard" (TensorBoardLogger); they share one version_N directory.
  std::vector<std::string> loggers = {"csv"};
  // Further loggers (used on rank 0, after the named ones).
  std::vector<std::shared_ptr<Logger>> logger_objects;
  // Run in this order at each hook (trainer/callbacks/callback.h). A ModelCheckpoint
  // here replaces the built-in checkpointing (last.ckpt, checkpoint_every_n_steps).
  std::vector<CallbackPtr> callbacks;
  // ---- Reproducibility ----
  // Sampler shuffling and the CPU RNG before configure_model; 0 (not given):
  // the seed of the last SeedEverything (trainer/loops/run_controls.h), if any.
  uint64_t seed = 0;
  // Deterministic algorithms only (at::globalContext); an operation without
  // one fails Fit with an error that names it (trainer/loops/run_controls.h).
  bool deterministic = false;
  // ---- Data: the data loader part (Lightning keeps it in the DataLoader) ----
  int64_t batch_size = 8;      // per rank
  int64_t val_batch_size = 0;  // 0: batch_size
  bool shuffle = true;
  bool drop_last = false;      // drop the last partial batch; ranks are always padded to equal shares
  // ---- Background loading (data) ----
  // Threads per rank that prepare the training and validation batches ahead
  // of the step (trainer/data/data_loader.h), in the sampler's order: the same
  // batches, hence the same losses, at any value; 0: on the training thread.
  // With > 0 the Dataset's get_batch runs on several threads at once.
  // In [0, kMaxDataLoaderWorkers].
  int num_workers = 0;
  // Batches prepared ahead per worker (>= 1; at most num_workers *
  // prefetch_factor wait at a time). Unused when num_workers is 0.
  int prefetch_factor = 2;
  // ---- Resuming and the processes' time limit ----
  // "never", or "auto": a Fit given no ckpt_path resumes from the newest
  // complete checkpoint under default_root_dir when there is one
  // (FindLatestCheckpoint in trainer/checkpoint_io/resume.h; as ckpt_path="last"), and
  // starts afresh when there is none: a requeued SLURM job or a torchrun
  // --max-restarts restart continues with the same command line.
  std::string resume = "never";
  // Limit on every collective and on the rendezvous (meeting the other
  // ranks) of a Trainer that makes its own processes; PyTorch's default.
  // Must be > 0. (An injected communicator keeps its own.)
  std::chrono::milliseconds timeout = std::chrono::minutes(30);

  // ---- Run controls (trainer/loops/run_controls.h, trainer/callbacks/model_summary.h) ----
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
  // As limit_val_batches, for Test and Predict (LimitBatches in trainer/loops/run_controls.h).
  double limit_test_batches = 1.0;
  double limit_predict_batches = 1.0;
  // At the start of Fit rank 0 prints a table of the model's units:
  // parameters, trainable, shard elements and bytes per rank (trainer/callbacks/model_summary.h).
  bool enable_model_summary = true;

  // ---- Profiling and SyncBatchNorm (trainer/profilers/profiler.h, trainer/plugins/sync_batchnorm.h) ----
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
  // global batch of all ranks (trainer/plugins/sync_batchnorm.h: the model must call
  // its BatchNorm through the module tree, ForwardBatchNorm).
  bool sync_batchnorm = false;

  // ---- Faults: non-finite values, stalled peers ----
  // A step whose loss or a gradient is NaN/Inf on any rank: "off" (trains
  // on), "error" (every rank throws NonfiniteError naming the step and, on
  // the rank that found it, the loss or the first parameter), "skip" (every
  // rank skips that optimizer step; counted). See trainer/loops/nonfinite.h.
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

// Checks `options` as the Trainer's constructor does, building nothing: every
// range and choice, the run controls, the precision, the strategy's name and
// options, the accelerator's availability. Throws InvalidArgumentError naming
// the option and what is valid. A program that reads options from flags or a
// file calls it to fail before it starts ranks (examples/common/trainer_flags.cc).
void CheckTrainerOptions(const TrainerOptions& options);

// ---- Predict's options (trainer/loops/eval_loop.cc) ----
struct PredictOptions {
  // true: every rank returns every sample's prediction, in dataset order
  // (one all-gather: W times a rank's share in memory on every rank).
  // false: no communication; each rank returns its own share, samples
  // rank, rank + W, rank + 2W, ... < dataset size (the DistributedSampler's
  // order without shuffling, padding duplicates dropped): for outputs too
  // large to hold W times, e.g. to write one file per rank.
  bool gather = true;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_TRAINER_OPTIONS_H_
