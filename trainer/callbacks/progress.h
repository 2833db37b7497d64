// Progress reporting on rank 0: a live bar redrawn with '\r' when stdout is a
// terminal, periodic plain lines otherwise, with step, loss, throughput (it/s),
// ETA and the metrics logged with prog_bar. Plain C++ (no torch header).
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_PROGRESS_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

namespace shardtrain::trainer {

class ProgressReporter {
 public:
  // total_steps <= 0: unknown (no ETA). `out` defaults to stdout; `tty` decides
  // between the live bar and plain lines (auto-detected when out is stdout).
  ProgressReporter(int64_t total_steps, int64_t every_n_steps, std::FILE* out = stdout, int tty = -1);
  // Called after optimizer step `step` (1-based count of steps done).
  // `metrics`: what the module logged with prog_bar (LogOptions), shown
  // after the loss as "name 0.1234" in name order.
  void Update(int64_t epoch, int64_t step, double loss, const std::map<std::string, double>& metrics = {});
  void Finish();
  // The text of one report (for tests).
  std::string Format(int64_t epoch, int64_t step, double loss, double its,
                     const std::map<std::string, double>& metrics = {}) const;

 private:
  int64_t total_;
  int64_t every_;
  std::FILE* out_;
  bool tty_;
  int64_t first_step_ = -1;
  std::chrono::steady_clock::time_point start_;
  bool dirty_ = false;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_PROGRESS_H_
