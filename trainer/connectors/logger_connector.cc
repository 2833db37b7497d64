// The logger connector: the loggers TrainerOptions names (rank 0), their
// hyper-parameters, and the checkpoint directory every rank agrees on.
#include <filesystem>

#include "trainer/loggers/csv_logger.h"
#include "trainer/loggers/tensorboard_logger.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

void Trainer::SetupLoggers(TrainingModule& module) {
  if (loggers_set_up_) return;
  const auto& o = options_;
  loggers_.clear();
  if (rank() == 0 && o.enable_logger) {
    int version = -1;
    for (const auto& name : o.loggers) {
      if (name == "csv") {
        auto l = std::make_shared<CsvLogger>(o.default_root_dir, o.logger_name, version);
        version = l->version();
        loggers_.push_back(l);
      } else if (name == "tensorboard") {
        auto l = std::make_shared<TensorBoardLogger>(o.default_root_dir, o.logger_name, version);
        version = l->version();
        loggers_.push_back(l);
      }
    }
    for (const auto& l : o.logger_objects) {
      if (l) loggers_.push_back(l);
    }
    auto hp = module.hparams();
    hp.emplace("strategy", strategy_->name());
    hp.emplace("precision", o.precision);
    hp.emplace("accelerator", accelerator_);
    hp.emplace("world_size", std::to_string(world_size()));
    hp.emplace("batch_size", std::to_string(o.batch_size));
    hp.emplace("accumulate_grad_batches", std::to_string(o.accumulate_grad_batches));
    hp.emplace("seed", std::to_string(o.seed));
    for (auto& l : loggers_) l->LogHyperparams(hp);
  }
  // Every rank must agree on the directory: rank 0 has the loggers.
  const std::string root = BroadcastString(loggers_.empty() ? o.default_root_dir : loggers_.front()->log_dir());
  ckpt_dir_ = (fs::path(root) / "checkpoints").string();
  loggers_set_up_ = true;
}

}  // namespace shardtrain::trainer
