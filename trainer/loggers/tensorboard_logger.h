// TensorBoardLogger: scalars in TensorBoard's event-file format, in
// Lightning's TensorBoardLogger layout:
//   <root>/<name>/version_<N>/events.out.tfevents.<unix seconds>.<hostname>
//   <root>/<name>/version_<N>/hparams.yaml
// Plain C++: no protobuf or TensorFlow dependency. The file is a sequence of
// TFRecords
//   uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
// (little endian; masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8), each
// holding a tensorflow.Event protobuf encoded here by hand:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first record carries file_version "brain.Event:2"; then one Event per
// LogMetrics call with one Value per metric.
#ifndef SHARDTRAIN_TRAINER_LOGGERS_TENSORBOARD_LOGGER_H_
#define SHARDTRAIN_TRAINER_LOGGERS_TENSORBOARD_LOGGER_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "trainer/loggers/logger.h"

namespace shardtrain::trainer {

class TensorBoardLogger : public Logger {
 public:
  // version < 0: the next free version_N under <root>/<name> (pass the CSV
  // logger's version to share its directory).
  TensorBoardLogger(std::string root_dir, std::string name = "lightning_logs", int version = -1);
  ~TensorBoardLogger() override;
  TensorBoardLogger(const TensorBoardLogger&) = delete;
  TensorBoardLogger& operator=(const TensorBoardLogger&) = delete;

  const std::string& log_dir() const override { return log_dir_; }
  int version() const { return version_; }
  const std::string& event_file() const { return event_file_; }

  // hparams.yaml (as CsvLogger writes it).
  void LogHyperparams(const std::map<std::string, std::string>& hparams) override;
  // One event at `step` with a scalar per metric.
  void LogMetrics(const std::map<std::string, double>& metrics, int64_t step) override;
  void AddScalar(const std::string& tag, double value, int64_t step);
  // Flushes the event file to the OS.
  void Save() override;

 private:
  void Write(const std::string& event);

  std::string log_dir_;
  int version_;
  std::string event_file_;
  std::FILE* file_ = nullptr;
};

namespace tensorboard {
// CRC-32C (Castagnoli), as TFRecord uses it.
uint32_t Crc32c(const void* data, size_t n);
uint32_t MaskedCrc32c(const void* data, size_t n);
// One framed record.
std::string TfRecord(const std::string& data);
// Serialized Event protos.
std::string FileVersionEvent(double wall_time);
std::string ScalarsEvent(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
}  // namespace tensorboard

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_LOGGERS_TENSORBOARD_LOGGER_H_
