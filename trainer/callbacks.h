// Callbacks: code the Trainer runs at fixed points of Fit (Lightning's
// Callback), given in TrainerOptions::callbacks, and three implementations:
//
//   ModelCheckpoint       checkpoints every N training steps and/or epochs,
//                         last.ckpt, and the top k by a monitored metric
//   LearningRateMonitor   logs each parameter group's learning rate to the loggers
//   EarlyStopping         stops Fit when a monitored metric stops improving
//
//   TrainerOptions o;
//   ModelCheckpointOptions mc;
//   mc.monitor = "val_loss"; mc.save_top_k = 2; mc.save_last = true;
//   o.callbacks = {std::make_shared<ModelCheckpoint>(mc), std::make_shared<EarlyStopping>()};
//
// Every rank runs every callback at the same points. Metrics
// (Trainer::callback_metrics: train_loss, val_loss and what the module
// log()s) are reduced over the ranks, so they are identical on every rank;
// decisions that change the run (EarlyStopping) are additionally taken on
// rank 0 and broadcast, and the Trainer all-reduces its stop flag, so every
// rank stops after the same step. Checkpoint saves are collective (every rank
// calls Trainer::SaveCheckpoint); files are written and deleted by rank 0 (or
// by every rank for its own shard file in sharded checkpoints).
//
// A callback's state_dict() is stored in checkpoints under its state_key() and
// restored on resume (ModelCheckpoint's best models, EarlyStopping's counters).
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainer/data.h"

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer {

class Trainer;
class TrainingModule;

class Callback {
 public:
  virtual ~Callback() = default;

  // After setup and any resume, before the first batch.
  virtual void on_fit_start(Trainer& trainer, TrainingModule& module) {}
  // After the last checkpoint of Fit.
  virtual void on_fit_end(Trainer& trainer, TrainingModule& module) {}
  // After every training batch (micro-batch), once the optimizer step it
  // completes (if any) is done: trainer.global_step() counts it. A stop
  // requested here (trainer.set_should_stop) on any rank ends Fit after this
  // step on every rank (see Trainer::set_should_stop).
  virtual void on_train_batch_end(Trainer& trainer, TrainingModule& module, const at::Tensor& loss,
                                  int64_t batch_idx) {}
  // Before and after each validation pass, in Fit and in Trainer::Validate
  // (trainer.fitting() tells which); at the end callback_metrics has val_loss.
  virtual void on_validation_start(Trainer& trainer, TrainingModule& module) {}
  virtual void on_validation_end(Trainer& trainer, TrainingModule& module) {}
  // ---- Test and the evaluation epoch ends ----
  // Around Trainer::Test; at the end callback_metrics has the test metrics.
  virtual void on_test_start(Trainer& trainer, TrainingModule& module) {}
  virtual void on_test_end(Trainer& trainer, TrainingModule& module) {}
  // After a validation / test pass, once its metrics are in callback_metrics
  // (and after the module's hook of the same name), before they are logged.
  virtual void on_validation_epoch_end(Trainer& trainer, TrainingModule& module) {}
  virtual void on_test_epoch_end(Trainer& trainer, TrainingModule& module) {}
  // Before the first batch of training epoch `epoch` (0-based; not when a
  // resumed Fit continues an epoch mid-way), after the module's hook.
  virtual void on_train_epoch_start(Trainer& trainer, TrainingModule& module, int64_t epoch) {}
  // After training epoch `epoch` (0-based) ended; trainer.current_epoch() is
  // already epoch + 1 (a checkpoint taken here resumes with the next epoch).
  virtual void on_train_epoch_end(Trainer& trainer, TrainingModule& module, int64_t epoch) {}

  // ---- Hooks of the training step, checkpoints and failures ---------------
  // Each runs on every rank, after the module's hook of the same name
  // (trainer/training_module.h describes the order within a step).
  // Before training_step of every micro-batch (the batch is on the device).
  virtual void on_train_batch_start(Trainer& trainer, TrainingModule& module, const Batch& batch,
                                    int64_t batch_idx) {}
  // Before backward of every micro-batch; `loss` is what backward gets (the
  // loss / accumulate_grad_batches, before 16-mixed scaling).
  virtual void on_before_backward(Trainer& trainer, TrainingModule& module, const at::Tensor& loss) {}
  virtual void on_after_backward(Trainer& trainer, TrainingModule& module) {}
  // Once per optimizer step, after the step's collective (gradients
  // synchronized and unscaled), before clipping and optimizer.step().
  virtual void on_before_optimizer_step(Trainer& trainer, TrainingModule& module,
                                        torch::optim::Optimizer& optimizer) {}
  // Extra checkpoint state shared with the module (see
  // TrainingModule::on_save_checkpoint): written at every save (full or
  // sharded), read back on resume before on_fit_start.
  virtual void on_save_checkpoint(Trainer& trainer, TrainingModule& module,
                                  std::map<std::string, std::string>& checkpoint) {}
  virtual void on_load_checkpoint(Trainer& trainer, TrainingModule& module,
                                  const std::map<std::string, std::string>& checkpoint) {}
  // Fit is failing with `e` (Preempted included), after the module's
  // on_exception; then `e` propagates. Exceptions thrown here are logged and dropped.
  virtual void on_exception(Trainer& trainer, TrainingModule& module, const std::exception& e) {}

  // Key under which state_dict() is checkpointed ("" = stateless).
  virtual std::string state_key() const { return ""; }
  virtual std::map<std::string, std::string> state_dict() const { return {}; }
  virtual void load_state_dict(const std::map<std::string, std::string>& state) {}
};

using CallbackPtr = std::shared_ptr<Callback>;

// The key of the checkpoint's "callbacks" entry that holds the extra state of
// on_save_checkpoint / on_load_checkpoint (reserved: no callback's state_key).
inline constexpr char kExtraStateKey[] = "on_save_checkpoint";

struct ModelCheckpointOptions {
  // Directory; "" = the Trainer's checkpoint directory (<log_dir>/checkpoints).
  std::string dirpath;
  // Name template without extension (".ckpt" is added): {epoch}, {step} and
  // {metric} or {metric:.Nf} become "epoch=3", "step=120", "val_loss=0.1234".
  // "" = "{epoch}-{step}", plus "-{<monitor>:.4f}" with a monitor.
  std::string filename;
  // Metric to rank checkpoints by ("" = none: the k most recent are kept).
  std::string monitor;
  std::string mode = "min";  // "min" or "max"
  // Keep the best k (-1: all; 0: none besides last.ckpt).
  int64_t save_top_k = 1;
  // Also write <dirpath>/last.ckpt at every save.
  bool save_last = false;
  // Save every N optimizer steps (0: off).
  int64_t every_n_train_steps = 0;
  // Save at the end of every N epochs (0: off; -1: 1 unless every_n_train_steps is set).
  int64_t every_n_epochs = -1;
};

// Lightning's ModelCheckpoint. With one in TrainerOptions::callbacks the
// Trainer's own checkpointing (last.ckpt at epoch ends and at the end of Fit,
// checkpoint_every_n_steps) is off; this callback decides. Files are full
// checkpoints or, with a strategy that prefers them (fsdp_native
// state_dict_type=sharded), sharded checkpoint directories.
class ModelCheckpoint : public Callback {
 public:
  // Throws InvalidArgumentError for an invalid mode or counts.
  explicit ModelCheckpoint(ModelCheckpointOptions options = {});

  void on_fit_start(Trainer& trainer, TrainingModule& module) override;
  void on_train_batch_end(Trainer& trainer, TrainingModule& module, const at::Tensor& loss,
                          int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, TrainingModule& module, int64_t epoch) override;
  std::string state_key() const override;
  std::map<std::string, std::string> state_dict() const override;
  void load_state_dict(const std::map<std::string, std::string>& state) override;

  const ModelCheckpointOptions& options() const { return options_; }
  // Best checkpoint so far ("" before any) and its score.
  const std::string& best_model_path() const { return best_model_path_; }
  double best_model_score() const { return best_model_score_; }
  const std::string& last_model_path() const { return last_model_path_; }
  // The kept top-k checkpoints and their scores (by path).
  const std::map<std::string, double>& best_k_models() const { return best_k_; }
  // The file name for these values (template applied, ".ckpt" added).
  std::string FormatName(int64_t epoch, int64_t step, const std::map<std::string, double>& metrics) const;

 private:
  void Save(Trainer& trainer, int64_t epoch);

  ModelCheckpointOptions options_;
  std::string dir_;
  std::map<std::string, double> best_k_;
  std::string best_model_path_;
  double best_model_score_ = 0;
  std::string last_model_path_;
  int64_t last_step_saved_ = -1;
  std::map<std::string, std::string> pending_state_;  // from a checkpoint, applied in on_fit_start
};

struct LearningRateMonitorOptions {
  std::string logging_interval = "step";  // "step" or "epoch"
};

// Logs "lr-<Optimizer>" (with several parameter groups "lr-<Optimizer>/pg1",
// ".../pg2", ...) after every optimizer step or epoch, to the loggers (rank 0):
// once per lr scheduler, under the scheduler config's name or "lr-<Optimizer>",
// "lr-<Optimizer>-1", ... (Trainer::learning_rate_stats). Per step: the lr
// the step used, at its global step (with its train_loss, paired as in
// Lightning); per epoch: the lr of the next epoch (after epoch schedulers).
class LearningRateMonitor : public Callback {
 public:
  explicit LearningRateMonitor(LearningRateMonitorOptions options = {});
  void on_train_batch_end(Trainer& trainer, TrainingModule& module, const at::Tensor& loss,
                          int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, TrainingModule& module, int64_t epoch) override;
  // What was logged: (step, {name: lr}).
  const std::vector<std::pair<int64_t, std::map<std::string, double>>>& history() const { return history_; }

 private:
  void Log(Trainer& trainer, bool last_step);
  LearningRateMonitorOptions options_;
  int64_t last_step_ = -1;
  std::vector<std::pair<int64_t, std::map<std::string, double>>> history_;
};

struct EarlyStoppingOptions {
  std::string monitor = "val_loss";
  double min_delta = 0.0;  // an improvement must exceed this
  int64_t patience = 3;    // checks without improvement before stopping
  std::string mode = "min";
  // A missing monitor metric is an error (else the check is skipped).
  bool strict = true;
  // Stop when the metric becomes NaN or infinite.
  bool check_finite = true;
  // Stop as soon as the metric is better than this / worse than this.
  std::optional<double> stopping_threshold;
  std::optional<double> divergence_threshold;
  // Check at the end of each training epoch instead of after each validation.
  bool check_on_train_epoch_end = false;
};

// Lightning's EarlyStopping. The decision is taken on rank 0 and broadcast;
// Fit then ends on every rank after the same optimizer step. Validation
// outside Fit (Trainer::Validate) is not checked.
class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(EarlyStoppingOptions options = {});
  void on_validation_end(Trainer& trainer, TrainingModule& module) override;
  void on_train_epoch_end(Trainer& trainer, TrainingModule& module, int64_t epoch) override;
  std::string state_key() const override;
  std::map<std::string, std::string> state_dict() const override;
  void load_state_dict(const std::map<std::string, std::string>& state) override;

  int64_t wait_count() const { return wait_count_; }
  double best_score() const { return best_score_; }
  // Epoch in which it stopped Fit (-1: it did not).
  int64_t stopped_epoch() const { return stopped_epoch_; }
  const std::string& stop_reason() const { return reason_; }

 private:
  void Check(Trainer& trainer);
  EarlyStoppingOptions options_;
  int64_t wait_count_ = 0;
  double best_score_;
  int64_t stopped_epoch_ = -1;
  std::string reason_;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_H_
