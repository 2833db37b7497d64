#include "trainer/callbacks/learning_rate_monitor.h"

#include "base/errors.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {

// --- LearningRateMonitor -------------------------------------------------------

LearningRateMonitor::LearningRateMonitor(LearningRateMonitorOptions options) : options_(std::move(options)) {
  ST_CHECK_ARG(options_.logging_interval == "step" || options_.logging_interval == "epoch",
               "LearningRateMonitor: unknown logging_interval '", options_.logging_interval, "'; valid: step, epoch");
}

void LearningRateMonitor::Log(Trainer& trainer, bool last_step) {
  // Lightning's names per scheduler; after a step, the lr that step used.
  const std::map<std::string, double> row = trainer.learning_rate_stats(last_step);
  trainer.LogMetrics(row, trainer.global_step());
  history_.emplace_back(trainer.global_step(), row);
}

void LearningRateMonitor::on_train_batch_end(Trainer& trainer, TrainingModule&, const at::Tensor&, int64_t) {
  const int64_t step = trainer.global_step();
  if (options_.logging_interval != "step" || step <= 0 || step == last_step_) return;
  last_step_ = step;
  Log(trainer, /*last_step=*/true);
}

void LearningRateMonitor::on_train_epoch_end(Trainer& trainer, TrainingModule&, int64_t) {
  if (options_.logging_interval == "epoch") Log(trainer, /*last_step=*/false);
}

}  // namespace shardtrain::trainer
