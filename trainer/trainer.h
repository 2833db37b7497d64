// Trainer: the fit/validate loops (Lightning's Trainer).
//
//   TrainerOptions o;
//   o.strategy = "fsdp_native"; o.strategy_options = {{"sharding_strategy", "FULL_SHARD"}};
//   o.devices = 2; o.max_epochs = 3;
//   Trainer trainer(o);
//   trainer.Fit(module, train_set, &val_set);
//   return shardtrain::JoinLocalRanks(0);   // end of main() on rank 0
//
// Processes: with an injected communicator (threads-as-ranks tests, or a
// program that made its own) the Trainer uses it. Otherwise, for
// devices * num_nodes > 1, a process not started by a launcher re-executes its
// own binary for the other local ranks (comm/launcher.h LaunchLocalRanks), then
// every rank detects its place (comm/cluster_environment.h: torchrun, SLURM,
// MPI variables), meets the others through a TCPStore and talks Gloo.
//
// Loop: per epoch a DistributedSampler gives each rank its share (reshuffled
// with seed + epoch); every rank runs the same number of batches.
// accumulate_grad_batches micro-batches make one optimizer step (the first
// ones without gradient synchronization); gradients are clipped after
// synchronization; the loss is logged as the rank- and micro-batch mean.
// Checkpoints (trainer/checkpoint.h) go to <log_dir>/checkpoints/: last.ckpt at
// each epoch end and at the end of fit, and step=N.ckpt every
// checkpoint_every_n_steps. Fit(..., ckpt_path) resumes exactly where the
// checkpoint was taken (model, optimizer, loop position, RNG state).
#ifndef SHARDTRAIN_TRAINER_TRAINER_H_
#define SHARDTRAIN_TRAINER_TRAINER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "strategies/registry.h"
#include "strategies/strategy.h"
#include "trainer/data.h"
#include "trainer/training_module.h"

namespace shardtrain::trainer {

class CsvLogger;

struct TrainerOptions {
  std::string accelerator = "auto";  // "cpu" or "auto" (CPU: the only accelerator this build trains on)
  int devices = 1;                   // ranks per node
  int num_nodes = 1;
  // Strategy by registered name ("auto": ddp when several ranks, else
  // single_device) with string options, or an object (wins when set).
  std::string strategy = "auto";
  strategies::StrategyOptions strategy_options;
  strategies::StrategyPtr strategy_object;
  std::string precision = "32-true";  // "32-true", "bf16-mixed", "16-mixed", "bf16-true"
  int64_t max_epochs = 1;             // -1: unlimited (needs max_steps)
  int64_t max_steps = -1;             // optimizer steps; -1: no limit
  int64_t accumulate_grad_batches = 1;
  double gradient_clip_val = 0;       // 0: no clipping
  std::string gradient_clip_algorithm = "norm";  // "norm" or "value"
  // Validate every N training batches when > 1, or after this fraction of an
  // epoch when <= 1 (1.0: at each epoch end).
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
  uint64_t seed = 0;
  bool deterministic = false;
  // The data loader part (Lightning keeps it in the DataLoader).
  int64_t batch_size = 8;      // per rank
  int64_t val_batch_size = 0;  // 0: batch_size
  bool shuffle = true;
  bool drop_last = false;      // drop the last partial batch; ranks are always padded to equal shares
};

class Trainer {
 public:
  // Validates the options (InvalidArgumentError listing valid values).
  // `world`: an already connected communicator to use instead of launching.
  explicit Trainer(TrainerOptions options, comm::CommunicatorPtr world = nullptr);
  ~Trainer();

  // Trains `module` on `train`; validates on `val` when given. `ckpt_path`:
  // resume from this checkpoint.
  void Fit(TrainingModule& module, const Dataset& train, const Dataset* val = nullptr,
           const std::string& ckpt_path = "");
  // Runs validation once; returns the mean val_loss (NaN if validation_step
  // returns nothing). Uses the model of the last Fit, or sets one up.
  double Validate(TrainingModule& module, const Dataset& val);

  // Writes a full checkpoint (collective: every rank must call).
  void SaveCheckpoint(const std::string& path);

  const TrainerOptions& options() const { return options_; }
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

 private:
  void SetupProcesses();
  void SetupModel(TrainingModule& module);
  void LoadFrom(const std::string& path);
  double RunValidation(TrainingModule& module, const Dataset& val);
  int64_t LimitBatches(double limit, int64_t available) const;
  std::vector<std::string> GatherOptimizerStates();

  TrainerOptions options_;
  comm::CommunicatorPtr world_;
  strategies::StrategyPtr strategy_;
  TrainingModule* module_ = nullptr;
  OptimizerConfig opt_;
  std::vector<double> initial_lrs_;
  std::unique_ptr<CsvLogger> logger_;
  std::string ckpt_dir_;
  std::string last_ckpt_;
  int64_t epoch_ = 0;
  int64_t global_step_ = 0;
  int64_t batch_in_epoch_ = 0;
  std::vector<double> step_losses_;
  std::vector<double> val_losses_;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_TRAINER_H_
