// Internal to //trainer: the learning-rate schedulers of
// configure_optimizers — checked at setup, stepped at their interval, named
// for LearningRateMonitor, saved in and restored from checkpoints
// (trainer/trainer.h, "Learning-rate schedulers"). Owned by the Trainer;
// reads its optimizer and metrics.
#ifndef SHARDTRAIN_TRAINER_LOOPS_INTERNAL_LR_STEPPING_H_
#define SHARDTRAIN_TRAINER_LOOPS_INTERNAL_LR_STEPPING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "trainer/optim/lr_scheduler.h"

namespace shardtrain::trainer {

class Trainer;

namespace internal {

class LRStepping {
 public:
  explicit LRStepping(Trainer& trainer) : t_(trainer) {}
  LRStepping(const LRStepping&) = delete;
  LRStepping& operator=(const LRStepping&) = delete;

  // Checks the configs of configure_optimizers (one optimizer, valid
  // intervals) and adds lr_lambda as a LambdaLR.
  void Setup();
  // Steps the configs of `interval` due at `count` (global step, or epochs finished).
  void Step(const std::string& interval, int64_t count);
  // Trainer::learning_rate_stats.
  std::map<std::string, double> Stats(bool last_step) const;
  // Each config's state_dict() plus the optimizer's lrs and momentums.
  std::vector<SchedulerState> States() const;
  // Checks a checkpoint's scheduler states against this run's (throws naming
  // `path`, changing nothing) and returns what installs them.
  std::function<void()> PrepareLoad(const std::vector<SchedulerState>& states, int64_t global_step,
                                    const std::string& path);
  const std::vector<LRSchedulerConfig>& configs() const { return configs_; }

 private:
  Trainer& t_;
  std::vector<LRSchedulerConfig> configs_;
  int lr_lambda_index_ = -1;  // the config made from lr_lambda
  bool monitor_warned_ = false;
  std::vector<double> last_step_lrs_;  // the lrs the last optimizer step used
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_LOOPS_INTERNAL_LR_STEPPING_H_
