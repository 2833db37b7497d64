// CsvLogger: metrics in PyTorch Lightning's CSVLogger layout:
//   <root>/<name>/version_<N>/metrics.csv   one row per logged step; the header
//                                           is the sorted union of all keys
//                                           (with "epoch" and "step"); empty
//                                           cells where a row lacks a key
//   <root>/<name>/version_<N>/hparams.yaml  "key: value" lines
// N is the next free version number unless given. Plain C++ (no torch header).
#ifndef SHARDTRAIN_TRAINER_LOGGERS_CSV_LOGGER_H_
#define SHARDTRAIN_TRAINER_LOGGERS_CSV_LOGGER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trainer/loggers/logger.h"

namespace shardtrain::trainer {

class CsvLogger : public Logger {
 public:
  // version < 0: the next free version_N under <root>/<name>.
  CsvLogger(std::string root_dir, std::string name = "lightning_logs", int version = -1);

  const std::string& log_dir() const override { return log_dir_; }
  int version() const { return version_; }

  void LogHyperparams(const std::map<std::string, std::string>& hparams) override;
  // Buffers a row; `step` is written in the "step" column.
  void LogMetrics(const std::map<std::string, double>& metrics, int64_t step) override;
  // Rewrites metrics.csv with every row so far (atomically: temp file + rename).
  void Save() override;

 private:
  std::string log_dir_;
  int version_;
  std::vector<std::map<std::string, double>> rows_;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_LOGGERS_CSV_LOGGER_H_
