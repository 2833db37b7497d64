#include "trainer/callbacks/early_stopping.h"

#include <ATen/ops/full.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "base/errors.h"
#include "base/logging.h"
#include "trainer/callbacks/internal/metric_text.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
using internal::Available;
using internal::CheckMode;
using internal::Num;
using internal::ParseNum;

// --- EarlyStopping -------------------------------------------------------------

EarlyStopping::EarlyStopping(EarlyStoppingOptions options) : options_(std::move(options)) {
  CheckMode("EarlyStopping", options_.mode);
  ST_CHECK_ARG(!options_.monitor.empty(), "EarlyStopping: monitor must name a metric");
  ST_CHECK_ARG(options_.patience >= 0, "EarlyStopping: patience must be >= 0, got ", options_.patience);
  options_.min_delta = std::abs(options_.min_delta);
  best_score_ = options_.mode == "min" ? std::numeric_limits<double>::infinity()
                                       : -std::numeric_limits<double>::infinity();
}

void EarlyStopping::on_validation_end(Trainer& trainer, TrainingModule&) {
  if (!options_.check_on_train_epoch_end && trainer.fitting()) Check(trainer);
}

void EarlyStopping::on_train_epoch_end(Trainer& trainer, TrainingModule&, int64_t) {
  if (options_.check_on_train_epoch_end) Check(trainer);
}

void EarlyStopping::Check(Trainer& trainer) {
  const auto& metrics = trainer.callback_metrics();
  auto it = metrics.find(options_.monitor);
  if (it == metrics.end()) {
    ST_CHECK_ARG(!options_.strict, "EarlyStopping: the monitored metric '", options_.monitor,
                 "' is not available; available: ", Available(metrics));
    return;
  }
  const double current = it->second;
  const bool min = options_.mode == "min";
  auto better = [&](double a, double b) { return min ? a < b : a > b; };
  bool stop = false;
  std::ostringstream why;
  if (options_.check_finite && !std::isfinite(current)) {
    stop = true;
    why << "monitored metric " << options_.monitor << " = " << current << " is not finite";
  } else if (options_.stopping_threshold && better(current, *options_.stopping_threshold)) {
    stop = true;
    why << "stopping threshold reached: " << options_.monitor << " = " << current << " "
        << (min ? "<" : ">") << " " << *options_.stopping_threshold;
  } else if (options_.divergence_threshold && better(*options_.divergence_threshold, current)) {
    stop = true;
    why << "divergence threshold reached: " << options_.monitor << " = " << current << " "
        << (min ? ">" : "<") << " " << *options_.divergence_threshold;
  } else if (better(min ? current + options_.min_delta : current - options_.min_delta, best_score_)) {
    best_score_ = current;
    wait_count_ = 0;
  } else {
    ++wait_count_;
    if (wait_count_ >= options_.patience) {
      stop = true;
      why << "monitored metric " << options_.monitor << " did not improve in the last " << wait_count_
          << " checks; best score " << best_score_;
    }
  }
  // Rank 0 decides for everyone.
  at::Tensor flag = at::full({1}, stop ? 1.0 : 0.0, at::kDouble);
  trainer.strategy().Broadcast(flag, 0);
  stop = flag.item<double>() > 0;
  if (!stop) return;
  reason_ = why.str().empty() ? "rank 0 decided to stop" : why.str();
  stopped_epoch_ = trainer.current_epoch();
  trainer.set_should_stop(true);
  if (trainer.rank() == 0) ST_LOG(INFO) << "EarlyStopping: " << reason_ << "; stopping in epoch " << stopped_epoch_;
}

std::string EarlyStopping::state_key() const {
  return "EarlyStopping{'monitor': " + internal::PyRepr(options_.monitor) +
         ", 'mode': " + internal::PyRepr(options_.mode) + "}";
}

std::string EarlyStopping::legacy_state_key() const {
  return "EarlyStopping{monitor=" + options_.monitor + ", mode=" + options_.mode + "}";
}

StateDict EarlyStopping::checkpoint_state() const {
  return {{"wait_count", wait_count_},
          {"stopped_epoch", stopped_epoch_},
          {"best_score", ScoreTensor{best_score_}},
          {"patience", options_.patience},
          {"stopping_reason", reason_.empty() ? 0 : 1},  // Lightning's EarlyStoppingReason: 0 not stopped
          {"stopping_reason_message", reason_.empty() ? StateValue() : StateValue(reason_)}};
}

std::map<std::string, std::string> EarlyStopping::state_dict() const {
  return {{"wait_count", std::to_string(wait_count_)},
          {"best_score", Num(best_score_)},
          {"stopped_epoch", std::to_string(stopped_epoch_)},
          {"patience", std::to_string(options_.patience)}};
}

void EarlyStopping::load_state_dict(const std::map<std::string, std::string>& state) {
  if (auto it = state.find("wait_count"); it != state.end()) wait_count_ = std::stoll(it->second);
  if (auto it = state.find("best_score"); it != state.end()) best_score_ = ParseNum(it->second);
  if (auto it = state.find("stopped_epoch"); it != state.end()) stopped_epoch_ = std::stoll(it->second);
}

}  // namespace shardtrain::trainer
