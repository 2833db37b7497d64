// LearningRateMonitor: logs the learning rates (trainer/callbacks/callback.h).
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_LEARNING_RATE_MONITOR_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_LEARNING_RATE_MONITOR_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "trainer/callbacks/callback.h"

namespace shardtrain::trainer {

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

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_LEARNING_RATE_MONITOR_H_
