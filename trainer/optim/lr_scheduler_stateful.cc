// PyTorch's learning-rate schedulers that keep state of their own or
// compose others (torch/optim/lr_scheduler.py of the pinned torch):
// SequentialLR, OneCycleLR, ReduceLROnPlateau. The simple ones and the base
// class are in lr_scheduler.cc.
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "base/errors.h"
#include "trainer/optim/internal/lr_scheduler_util.h"
#include "trainer/optim/lr_scheduler.h"

namespace shardtrain::trainer {

using internal::Get;
using internal::GetDouble;
using internal::GetInt;
using internal::InitialLrs;
using internal::kPi;

// ---- SequentialLR ------------------------------------------------------------------

SequentialLR::SequentialLR(OptimizerPtr optimizer, std::vector<LRSchedulerPtr> schedulers,
                           std::vector<int64_t> milestones)
    : LRScheduler(std::move(optimizer)), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  ST_CHECK_ARG(!schedulers_.empty(), "SequentialLR expects at least one scheduler, but got none");
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    ST_CHECK_ARG(schedulers_[i] != nullptr, "SequentialLR: scheduler ", i, " is null");
    ST_CHECK_ARG(!schedulers_[i]->needs_metric(), "SequentialLR does not support ReduceLROnPlateau (it needs a metric "
                 "at each step), but got one at index ", i);
    ST_CHECK_ARG(schedulers_[i]->optimizer_.get() == optimizer_.get(), "SequentialLR expects all schedulers to belong "
                 "to its optimizer, but scheduler ", i, " (", schedulers_[i]->name(), ") has another");
  }
  ST_CHECK_ARG(milestones_.size() + 1 == schedulers_.size(), "SequentialLR expects one milestone fewer than "
               "schedulers, but got ", schedulers_.size(), " schedulers and ", milestones_.size(), " milestones");
  last_epoch_ = 0;
  SetGroupLrs(*optimizer_, base_lrs_);  // the initial lrs
  for (auto& s : schedulers_) RecursiveUndo(*s);
  schedulers_[0]->InitialStep();
  last_lr_ = schedulers_[0]->get_last_lr();
}

// PyTorch's recursive_undo: one step back for every scheduler (a nested
// SequentialLR's children, not the SequentialLR itself).
void SequentialLR::RecursiveUndo(LRScheduler& s) {
  if (auto* seq = dynamic_cast<SequentialLR*>(&s)) {
    for (auto& c : seq->schedulers_) RecursiveUndo(*c);
  } else {
    s.last_epoch_ -= 1;
  }
}

std::vector<double> SequentialLR::ComputeLr() { return GroupLrs(); }

void SequentialLR::step() {
  ++last_epoch_;
  const auto idx = std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin();
  LRScheduler& s = *schedulers_[idx];
  if (idx > 0 && milestones_[idx - 1] == last_epoch_) {
    s.UpdateLr(0);
  } else {
    s.step();
  }
  last_lr_ = s.get_last_lr();
}

SchedulerState SequentialLR::state_dict() const {
  SchedulerState out = {{"type", name()},
                        {"last_epoch", std::to_string(last_epoch_)},
                        {"_last_lr", DoublesToString(last_lr_)}};
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    for (const auto& [k, v] : schedulers_[i]->state_dict()) out[std::to_string(i) + "." + k] = v;
  }
  return out;
}

void SequentialLR::load_state_dict(const SchedulerState& state) {
  CheckType(state);
  const int64_t last_epoch = GetInt(state, "last_epoch", name());
  const auto last = DoublesFromString(Get(state, "_last_lr", name()));
  std::vector<SchedulerState> children(schedulers_.size());
  for (const auto& [k, v] : state) {
    const auto dot = k.find('.');
    if (dot == std::string::npos) continue;
    const size_t i = std::strtoull(k.substr(0, dot).c_str(), nullptr, 10);
    ST_CHECK_ARG(i < schedulers_.size(), "SequentialLR state holds scheduler ", i, " but this SequentialLR has ",
                 schedulers_.size());
    children[i][k.substr(dot + 1)] = v;
  }
  // Check every child before changing any: load into each, restoring on failure.
  std::vector<SchedulerState> before;
  for (auto& s : schedulers_) before.push_back(s->state_dict());
  try {
    for (size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_state_dict(children[i]);
  } catch (...) {
    for (size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_state_dict(before[i]);
    throw;
  }
  last_epoch_ = last_epoch;
  last_lr_ = last;
}

// ---- OneCycleLR -------------------------------------------------------------------

OneCycleLR::OneCycleLR(OptimizerPtr optimizer, OneCycleOptions options)
    : LRScheduler(std::move(optimizer)), o_(std::move(options)) {
  ST_CHECK_ARG(o_.total_steps > 0, "OneCycleLR: total_steps must be a positive integer, got ", o_.total_steps);
  ST_CHECK_ARG(o_.max_lr > 0, "OneCycleLR: max_lr must be > 0, got ", o_.max_lr);
  ST_CHECK_ARG(o_.pct_start >= 0 && o_.pct_start <= 1, "OneCycleLR: pct_start must be in [0, 1], got ", o_.pct_start);
  ST_CHECK_ARG(o_.anneal_strategy == "cos" || o_.anneal_strategy == "linear", "OneCycleLR: anneal_strategy must be "
               "'cos' or 'linear', got '", o_.anneal_strategy, "'");
  const double total = static_cast<double>(o_.total_steps);
  // Values: 0 initial_lr / max_momentum, 1 max_lr / base_momentum, 2 min_lr.
  if (o_.three_phase) {
    phases_ = {{o_.pct_start * total - 1, 0, 1, 0, 1},
               {2 * o_.pct_start * total - 2, 1, 0, 1, 0},
               {total - 1, 0, 2, 0, 0}};
  } else {
    phases_ = {{o_.pct_start * total - 1, 0, 1, 0, 1}, {total - 1, 1, 2, 1, 0}};
  }
  initial_lr_ = o_.max_lr / o_.div_factor;
  min_lr_ = initial_lr_ / o_.final_div_factor;
  base_lrs_ = InitialLrs(optimizer_, nullptr);
  base_lrs_.assign(base_lrs_.size(), initial_lr_);
  InitialLrs(optimizer_, &base_lrs_);  // PyTorch overwrites group["initial_lr"]
  if (o_.cycle_momentum) {
    ST_CHECK_ARG(!GroupMomentums(*optimizer_).empty(), "OneCycleLR: cycle_momentum needs an optimizer with momentum "
                 "(SGD) or betas (Adam, AdamW); set cycle_momentum = false for others");
    SetGroupMomentums(*optimizer_, std::vector<double>(optimizer_->param_groups().size(), o_.max_momentum));
  }
  InitialStep();
}

double OneCycleLR::Anneal(double start, double end, double pct) const {
  if (o_.anneal_strategy == "cos") {
    const double cos_out = std::cos(kPi * pct) + 1;
    return end + (start - end) / 2.0 * cos_out;
  }
  return (end - start) * pct + start;
}

std::vector<double> OneCycleLR::ComputeLr() {
  const int64_t step_num = last_epoch_;
  ST_CHECK_ARG(step_num <= o_.total_steps, "OneCycleLR: tried to step ", step_num,
               " times; the specified number of total steps is ", o_.total_steps,
               " (give total_steps = the optimizer steps of the run, e.g. trainer().estimated_stepping_batches())");
  const double lr_v[3] = {initial_lr_, o_.max_lr, min_lr_};
  const double m_v[2] = {o_.max_momentum, o_.base_momentum};
  double lr = 0, momentum = 0;
  double start_step = 0.0;
  for (size_t i = 0; i < phases_.size(); ++i) {
    const Phase& p = phases_[i];
    if (static_cast<double>(step_num) <= p.end_step || i + 1 == phases_.size()) {
      const double pct = (static_cast<double>(step_num) - start_step) / (p.end_step - start_step);
      lr = Anneal(lr_v[p.start_lr], lr_v[p.end_lr], pct);
      momentum = Anneal(m_v[p.start_m], m_v[p.end_m], pct);
      break;
    }
    start_step = p.end_step;
  }
  const size_t groups = optimizer_->param_groups().size();
  if (o_.cycle_momentum) SetGroupMomentums(*optimizer_, std::vector<double>(groups, momentum));
  return std::vector<double>(groups, lr);
}

// ---- ReduceLROnPlateau ----------------------------------------------------------

namespace {

OptimizerPtr CheckedPlateau(OptimizerPtr opt, const ReduceLROnPlateauOptions& o) {
  ST_CHECK_ARG(o.factor < 1.0, "ReduceLROnPlateau: factor should be < 1.0, got ", o.factor);
  ST_CHECK_ARG(o.mode == "min" || o.mode == "max", "ReduceLROnPlateau: mode '", o.mode, "' is unknown; valid: min, max");
  ST_CHECK_ARG(o.threshold_mode == "rel" || o.threshold_mode == "abs", "ReduceLROnPlateau: threshold_mode '",
               o.threshold_mode, "' is unknown; valid: rel, abs");
  ST_CHECK_ARG(o.patience >= 0 && o.cooldown >= 0, "ReduceLROnPlateau: patience and cooldown must be >= 0, got ",
               o.patience, " and ", o.cooldown);
  return opt;
}

}  // namespace

ReduceLROnPlateau::ReduceLROnPlateau(OptimizerPtr optimizer, ReduceLROnPlateauOptions options)
    : LRScheduler(CheckedPlateau(std::move(optimizer), options)), o_(std::move(options)) {
  // PyTorch's ReduceLROnPlateau does not take the base class's initial step.
  last_epoch_ = 0;
  last_lr_ = GroupLrs();
  best_ = o_.mode == "min" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
}

std::vector<double> ReduceLROnPlateau::ComputeLr() { return GroupLrs(); }

void ReduceLROnPlateau::step() {
  ST_THROW(InvalidArgumentError, "ReduceLROnPlateau.step needs the monitored metric: call step(metric)");
}

bool ReduceLROnPlateau::IsBetter(double a, double best) const {
  if (o_.mode == "min" && o_.threshold_mode == "rel") return a < best * (1.0 - o_.threshold);
  if (o_.mode == "min") return a < best - o_.threshold;
  if (o_.threshold_mode == "rel") return a > best * (o_.threshold + 1.0);
  return a > best + o_.threshold;
}

void ReduceLROnPlateau::step(double current) {
  last_epoch_ += 1;
  if (IsBetter(current, best_)) {
    best_ = current;
    num_bad_epochs_ = 0;
  } else {
    num_bad_epochs_ += 1;
  }
  if (cooldown_counter_ > 0) {
    cooldown_counter_ -= 1;
    num_bad_epochs_ = 0;
  }
  if (num_bad_epochs_ > o_.patience) {
    auto lrs = GroupLrs();
    for (double& old_lr : lrs) {
      const double new_lr = std::max(old_lr * o_.factor, o_.min_lr);
      if (old_lr - new_lr > o_.eps) old_lr = new_lr;
    }
    SetGroupLrs(*optimizer_, lrs);
    cooldown_counter_ = o_.cooldown;
    num_bad_epochs_ = 0;
  }
  last_lr_ = GroupLrs();
}

SchedulerState ReduceLROnPlateau::state_dict() const {
  return {{"type", name()},
          {"last_epoch", std::to_string(last_epoch_)},
          {"_last_lr", DoublesToString(last_lr_)},
          {"best", DoubleToString(best_)},
          {"num_bad_epochs", std::to_string(num_bad_epochs_)},
          {"cooldown_counter", std::to_string(cooldown_counter_)}};
}

void ReduceLROnPlateau::load_state_dict(const SchedulerState& state) {
  CheckType(state);
  const std::string t = name();
  const int64_t last_epoch = GetInt(state, "last_epoch", t);
  const auto last = DoublesFromString(Get(state, "_last_lr", t));
  const double best = GetDouble(state, "best", t);
  const int64_t bad = GetInt(state, "num_bad_epochs", t);
  const int64_t cool = GetInt(state, "cooldown_counter", t);
  last_epoch_ = last_epoch;
  last_lr_ = last;
  best_ = best;
  num_bad_epochs_ = bad;
  cooldown_counter_ = cool;
}

}  // namespace shardtrain::trainer
