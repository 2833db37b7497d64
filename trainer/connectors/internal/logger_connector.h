// Internal to //trainer: the logger connector — the loggers TrainerOptions
// names (rank 0) with the run's hyper-parameters, the checkpoint directory
// every rank agrees on, and the rows sent to them.
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_LOGGER_CONNECTOR_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_LOGGER_CONNECTOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "trainer/loggers/logger.h"

namespace shardtrain::trainer {

class Trainer;
class TrainingModule;

namespace internal {

class LoggerConnector {
 public:
  explicit LoggerConnector(Trainer& trainer) : t_(trainer) {}
  LoggerConnector(const LoggerConnector&) = delete;
  LoggerConnector& operator=(const LoggerConnector&) = delete;

  // Loggers (rank 0) and the checkpoint directory (every rank), once per Trainer.
  void SetupLoggers(TrainingModule& module);
  // A row of scalars to every logger, saved at once (rank 0; none elsewhere).
  void LogMetrics(const std::map<std::string, double>& metrics, int64_t step);
  // Writes what the loggers buffer.
  void Save();
  const std::vector<std::shared_ptr<Logger>>& loggers() const { return loggers_; }

 private:
  Trainer& t_;
  std::vector<std::shared_ptr<Logger>> loggers_;
  bool set_up_ = false;
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_LOGGER_CONNECTOR_H_
