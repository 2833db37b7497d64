// LR stepping (trainer/loops/internal/lr_stepping.h): the learning-rate
// schedulers of configure_optimizers — checked at setup, stepped at their
// interval, named for LearningRateMonitor, saved in and restored from
// checkpoints (trainer/trainer.h, "Learning-rate schedulers").
#include "trainer/loops/internal/lr_stepping.h"

#include <torch/optim/optimizer.h>

#include <sstream>

#include "base/errors.h"
#include "base/logging.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace {

std::string Names(const std::vector<LRSchedulerConfig>& configs) {
  std::string out;
  for (size_t i = 0; i < configs.size(); ++i) out += (i ? ", " : "") + configs[i].scheduler->name();
  return configs.empty() ? "none" : out;
}

std::string Names(const std::vector<SchedulerState>& states) {
  std::string out;
  for (size_t i = 0; i < states.size(); ++i) {
    auto it = states[i].find("type");
    out += (i ? ", " : "") + (it == states[i].end() ? std::string("?") : it->second);
  }
  return states.empty() ? "none" : out;
}

}  // namespace

void internal::LRStepping::Setup() {
  configs_ = t_.opt_.lr_schedulers;
  lr_lambda_index_ = -1;
  monitor_warned_ = false;
  last_step_lrs_.clear();
  if (t_.opt_.lr_lambda) {
    lr_lambda_index_ = static_cast<int>(configs_.size());
    LRSchedulerConfig c;
    c.scheduler = std::make_shared<LambdaLR>(t_.opt_.optimizer, t_.opt_.lr_lambda);
    c.interval = "step";
    configs_.push_back(std::move(c));
  }
  for (size_t i = 0; i < configs_.size(); ++i) {
    const auto& c = configs_[i];
    ST_CHECK_ARG(c.scheduler != nullptr, "configure_optimizers: lr_schedulers[", i, "] has no scheduler");
    ST_CHECK_ARG(c.scheduler->optimizer_ptr().get() == t_.opt_.optimizer.get(), "configure_optimizers: lr_schedulers[",
                 i, "] (", c.scheduler->name(),
                 ") schedules an optimizer other than the one returned. ShardTrain trains one optimizer per module: "
                 "Lightning steps several only under manual optimization, which ShardTrain does not have, and the "
                 "checkpoint and sharded optimizer state hold one optimizer. Give parameter groups of the one "
                 "optimizer their own lrs (several schedulers may step it)");
    ST_CHECK_ARG(c.interval == "step" || c.interval == "epoch", "configure_optimizers: lr_schedulers[", i,
                 "].interval is '", c.interval, "'; valid: step, epoch");
    ST_CHECK_ARG(c.frequency >= 1, "configure_optimizers: lr_schedulers[", i, "].frequency must be >= 1, got ",
                 c.frequency);
    ST_CHECK_ARG(!c.scheduler->needs_metric() || !c.monitor.empty(), "configure_optimizers: lr_schedulers[", i,
                 "] is a ", c.scheduler->name(), ": monitor must name a metric (e.g. val_loss, train_loss)");
  }
}

void internal::LRStepping::Step(const std::string& interval, int64_t count) {
  if (interval == "step") last_step_lrs_ = GroupLrs(*t_.opt_.optimizer);
  for (size_t i = 0; i < configs_.size(); ++i) {
    auto& c = configs_[i];
    if (c.interval != interval || count % c.frequency != 0) continue;
    if (!c.scheduler->needs_metric()) {
      c.scheduler->step();
      continue;
    }
    auto it = t_.callback_metrics_.find(c.monitor);
    if (it == t_.callback_metrics_.end()) {
      std::ostringstream avail;
      for (const auto& [k, v] : t_.callback_metrics_) avail << (avail.tellp() > 0 ? ", " : "") << k;
      const std::string available = avail.str().empty() ? "none" : avail.str();
      ST_CHECK_ARG(!c.strict, c.scheduler->name(), " (lr_schedulers[", i, "]) is conditioned on metric '", c.monitor,
                   "', which is not available at this ", interval, " end; available metrics: ", available,
                   ". Set LRSchedulerConfig::monitor to one of them, or strict = false to skip such steps");
      if (t_.rank() == 0 && !monitor_warned_) {
        ST_LOG(WARNING) << c.scheduler->name() << " conditioned on metric '" << c.monitor
                        << "', which is not available (available: " << available << "); skipping its step";
      }
      monitor_warned_ = true;
      continue;
    }
    c.scheduler->step(it->second);
  }
}

std::map<std::string, double> internal::LRStepping::Stats(bool last_step) const {
  std::map<std::string, double> out;
  if (!t_.opt_.optimizer) return out;
  const auto lrs = last_step && !last_step_lrs_.empty() ? last_step_lrs_ : GroupLrs(*t_.opt_.optimizer);
  const std::string opt_name = "lr-" + t_.optimizer_name();
  auto add = [&](const std::string& name) {
    for (size_t g = 0; g < lrs.size(); ++g) out[lrs.size() == 1 ? name : name + "/pg" + std::to_string(g + 1)] = lrs[g];
  };
  if (configs_.empty()) {
    add(opt_name);
    return out;
  }
  int unnamed = 0;  // Lightning counts unnamed schedulers of the optimizer's type
  for (const auto& c : configs_) {
    std::string name = c.name;
    if (name.empty()) {
      ++unnamed;
      name = opt_name;
    }
    if (unnamed > 1) name += "-" + std::to_string(unnamed - 1);
    add(name);
  }
  return out;
}

std::vector<SchedulerState> internal::LRStepping::States() const {
  std::vector<SchedulerState> out;
  for (const auto& c : configs_) {
    SchedulerState st = c.scheduler->state_dict();
    st["optimizer_lrs"] = DoublesToString(GroupLrs(*t_.opt_.optimizer));
    st["optimizer_momentums"] = DoublesToString(GroupMomentums(*t_.opt_.optimizer));
    out.push_back(std::move(st));
  }
  return out;
}

std::function<void()> internal::LRStepping::PrepareLoad(const std::vector<SchedulerState>& states, int64_t global_step,
                                                        const std::string& path) {
  if (states.empty() && configs_.empty()) return [] {};  // no schedule saved, none to restore
  if (states.empty() && configs_.size() == 1 && lr_lambda_index_ == 0) {
    // A checkpoint of a run whose only schedule was lr_lambda, written before
    // scheduler states were saved: the schedule is a function of the step.
    auto sched = configs_[0].scheduler;
    return [sched, global_step] {
      for (int64_t s = 0; s < global_step; ++s) sched->step();
    };
  }
  if (states.size() != configs_.size()) {
    ST_THROW(Error, "checkpoint '", path, "' holds the state of ", states.size(), " lr schedulers (", Names(states),
             ") but configure_optimizers returned ", configs_.size(), " (", Names(configs_), "); nothing was loaded");
  }
  // Python's schedulers do not write their class name: a state without one is its scheduler's.
  std::vector<SchedulerState> typed = states;
  for (size_t i = 0; i < typed.size(); ++i) typed[i].emplace("type", configs_[i].scheduler->name());
  std::vector<double> lrs, momentums;
  // Load each into its scheduler to check it, then put the current state back.
  for (size_t i = 0; i < typed.size(); ++i) {
    auto& s = *configs_[i].scheduler;
    const SchedulerState before = s.state_dict();
    try {
      s.load_state_dict(typed[i]);
      s.load_state_dict(before);
      auto get = [&](const char* key) {
        auto it = typed[i].find(key);
        ST_CHECK_ARG(it != typed[i].end(), "scheduler state lacks the key '", key, "'");
        return DoublesFromString(it->second);
      };
      lrs = get("optimizer_lrs");
      momentums = get("optimizer_momentums");
    } catch (const std::exception& e) {
      ST_THROW(Error, "checkpoint '", path, "': lr_schedulers[", i, "] (", s.name(), "): ", e.what(),
               "; nothing was loaded");
    }
  }
  const size_t groups = t_.opt_.optimizer->param_groups().size();
  const bool momentum_fits = momentums.empty() || GroupMomentums(*t_.opt_.optimizer).size() == momentums.size();
  if (lrs.size() != groups || !momentum_fits) {
    ST_THROW(Error, "checkpoint '", path, "': the saved optimizer has ", lrs.size(),
             " parameter groups (lrs and momentums), this run's ", groups, "; nothing was loaded");
  }
  return [this, typed, lrs, momentums] {
    for (size_t i = 0; i < typed.size(); ++i) configs_[i].scheduler->load_state_dict(typed[i]);
    SetGroupLrs(*t_.opt_.optimizer, lrs);
    SetGroupMomentums(*t_.opt_.optimizer, momentums);
  };
}

}  // namespace shardtrain::trainer
