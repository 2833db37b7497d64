#include "trainer/callbacks/progress.h"

#include <unistd.h>

#include <cmath>
#include <sstream>
#include <iomanip>

namespace shardtrain::trainer {

ProgressReporter::ProgressReporter(int64_t total_steps, int64_t every_n_steps, std::FILE* out, int tty)
    : total_(total_steps), every_(every_n_steps > 0 ? every_n_steps : 1), out_(out) {
  tty_ = tty >= 0 ? tty != 0 : (out == stdout && ::isatty(STDOUT_FILENO));
}

std::string ProgressReporter::Format(int64_t epoch, int64_t step, double loss, double its,
                                     const std::map<std::string, double>& metrics) const {
  std::ostringstream os;
  os << "epoch " << epoch << " step " << step;
  if (total_ > 0) os << "/" << total_;
  if (tty_ && total_ > 0) {
    const int width = 20;
    int filled = static_cast<int>(width * std::min<double>(1.0, static_cast<double>(step) / total_));
    os << " [" << std::string(filled, '#') << std::string(width - filled, '.') << "]";
  }
  os << " loss " << std::fixed << std::setprecision(4) << loss;
  for (const auto& [name, value] : metrics) os << " " << name << " " << value;
  os << " " << std::setprecision(2) << its << " it/s";
  if (total_ > 0 && its > 0) {
    int64_t secs = static_cast<int64_t>(std::llround((total_ - step) / its));
    os << " ETA " << secs / 3600 << ":" << std::setw(2) << std::setfill('0') << (secs / 60) % 60 << ":" << std::setw(2)
       << secs % 60;
  }
  return os.str();
}

void ProgressReporter::Update(int64_t epoch, int64_t step, double loss, const std::map<std::string, double>& metrics) {
  auto now = std::chrono::steady_clock::now();
  if (first_step_ < 0) {
    first_step_ = step - 1;
    start_ = now;
  }
  if (!tty_ && step % every_ != 0 && step != total_) return;
  const double secs = std::chrono::duration<double>(now - start_).count();
  const double its = secs > 0 ? (step - first_step_) / secs : 0.0;
  std::string line = Format(epoch, step, loss, its, metrics);
  if (tty_) {
    std::fprintf(out_, "\r%s\033[K", line.c_str());
    dirty_ = true;
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void ProgressReporter::Finish() {
  if (dirty_) std::fprintf(out_, "\n");
  dirty_ = false;
  std::fflush(out_);
}

}  // namespace shardtrain::trainer
