// ModelCheckpoint: Lightning's checkpointing callback (trainer/callbacks/callback.h).
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_MODEL_CHECKPOINT_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_MODEL_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>

#include "trainer/callbacks/callback.h"

namespace shardtrain::trainer {

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
  // Lightning's key and state (scores as tensors), so each side resumes the other's.
  std::string state_key() const override;
  std::string legacy_state_key() const override;
  std::map<std::string, std::string> state_dict() const override;
  void load_state_dict(const std::map<std::string, std::string>& state) override;
  StateDict checkpoint_state() const override;
  void load_checkpoint_state(const StateDict& state) override;

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
  // Whether score a beats b (mode, or the step when there is no monitor).
  bool Better(double a, double b) const;
  // The kept checkpoint with the worst score ("" when none is kept).
  std::string WorstKept() const;

  ModelCheckpointOptions options_;
  std::string dir_;
  std::map<std::string, double> best_k_;
  std::string best_model_path_;
  double best_model_score_ = 0;
  std::string last_model_path_;
  int64_t last_step_saved_ = -1;
  std::map<std::string, std::string> pending_state_;  // from a checkpoint, applied in on_fit_start
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_MODEL_CHECKPOINT_H_
