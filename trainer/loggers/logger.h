// Logger: where the Trainer sends metrics and hyperparameters (rank 0 only).
// Implementations: CsvLogger (trainer/loggers/csv_logger.h, Lightning's CSVLogger
// layout) and TensorBoardLogger (trainer/loggers/tensorboard_logger.h, event files
// TensorBoard reads). Plain C++ (no torch header).
#ifndef SHARDTRAIN_TRAINER_LOGGERS_LOGGER_H_
#define SHARDTRAIN_TRAINER_LOGGERS_LOGGER_H_

#include <cstdint>
#include <map>
#include <string>

namespace shardtrain::trainer {

class Logger {
 public:
  virtual ~Logger() = default;
  // The run's directory (<root>/<name>/version_N).
  virtual const std::string& log_dir() const = 0;
  virtual void LogHyperparams(const std::map<std::string, std::string>& hparams) = 0;
  // Scalars of one step.
  virtual void LogMetrics(const std::map<std::string, double>& metrics, int64_t step) = 0;
  // Makes everything logged so far durable (the Trainer calls it after each row).
  virtual void Save() {}
};

// Creates and returns Lightning's run directory <root_dir>/<name>/version_N.
// A negative *version picks the next free N and stores it. `logger` names the
// caller in errors.
std::string MakeVersionedLogDir(const std::string& logger, const std::string& root_dir, const std::string& name,
                                int* version);

// Writes <log_dir>/hparams.yaml atomically, one "key: value" line per entry
// (values quoted where YAML needs it). The one writer both loggers use.
void WriteHparamsYaml(const std::string& log_dir, const std::map<std::string, std::string>& hparams);

// A number for hparams(): the shortest text that reads back as the same
// double (1e-05 stays 1e-05; std::to_string would write 0.000010, and 1e-7
// as 0.000000).
std::string HparamValue(double value);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_LOGGERS_LOGGER_H_
