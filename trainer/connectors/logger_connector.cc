// The logger connector (trainer/connectors/internal/logger_connector.h): the
// loggers TrainerOptions names (rank 0), their hyper-parameters, and the
// checkpoint directory every rank agrees on.
#include "trainer/connectors/internal/logger_connector.h"

#include <filesystem>

#include "trainer/connectors/internal/process_connector.h"
#include "trainer/loggers/csv_logger.h"
#include "trainer/loggers/tensorboard_logger.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

void internal::LoggerConnector::SetupLoggers(TrainingModule& module) {
  if (set_up_) return;
  const auto& o = t_.options_;
  loggers_.clear();
  if (t_.rank() == 0 && o.enable_logger) {
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
    auto hp = ToStrings(module.hyper_parameters());
    hp.emplace("strategy", t_.strategy_->name());
    hp.emplace("precision", o.precision);
    hp.emplace("accelerator", t_.accelerator_);
    hp.emplace("world_size", std::to_string(t_.world_size()));
    hp.emplace("batch_size", std::to_string(o.batch_size));
    hp.emplace("accumulate_grad_batches", std::to_string(o.accumulate_grad_batches));
    hp.emplace("seed", std::to_string(o.seed));
    for (auto& l : loggers_) l->LogHyperparams(hp);
  }
  // Every rank must agree on the directory: rank 0 has the loggers.
  const std::string root =
      t_.process_connector_->BroadcastString(loggers_.empty() ? o.default_root_dir : loggers_.front()->log_dir());
  t_.ckpt_dir_ = (fs::path(root) / "checkpoints").string();
  set_up_ = true;
}

void internal::LoggerConnector::LogMetrics(const std::map<std::string, double>& metrics, int64_t step) {
  for (auto& l : loggers_) {
    l->LogMetrics(metrics, step);
    l->Save();
  }
}

void internal::LoggerConnector::Save() {
  for (auto& l : loggers_) l->Save();
}

}  // namespace shardtrain::trainer
