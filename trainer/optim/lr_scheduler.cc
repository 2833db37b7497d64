// PyTorch's learning-rate schedulers (torch/optim/lr_scheduler.py of the
// pinned torch), written from their documented formulas: the chainable
// get_lr forms, the closed forms SequentialLR uses at milestones, and the
// construction order (initial lrs registered once per optimizer).
#include "trainer/optim/lr_scheduler.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <sstream>
#include <utility>

#include "base/errors.h"
#include "trainer/optim/internal/lr_scheduler_util.h"

namespace shardtrain::trainer {
namespace {

// Python's a % b (non-negative for b > 0).
int64_t PyMod(int64_t a, int64_t b) { return ((a % b) + b) % b; }

// PyTorch's param_group["initial_lr"]: the first scheduler of an optimizer
// sets it (setdefault), later schedulers of the same optimizer read it.
// Keyed by the optimizer; an entry whose optimizer is gone is replaced.
struct InitialLrRegistry {
  std::mutex mu;
  std::map<const torch::optim::Optimizer*, std::pair<std::weak_ptr<torch::optim::Optimizer>, std::vector<double>>>
      lrs;
};

InitialLrRegistry& Registry() {
  static InitialLrRegistry* r = new InitialLrRegistry();
  return *r;
}

}  // namespace

namespace internal {

std::vector<double> InitialLrs(const OptimizerPtr& opt, const std::vector<double>* overwrite) {
  auto& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.lrs.begin(); it != r.lrs.end();) {
    it = it->second.first.expired() ? r.lrs.erase(it) : std::next(it);
  }
  auto& entry = r.lrs[opt.get()];
  const size_t groups = opt->param_groups().size();
  if (overwrite) {
    entry = {opt, *overwrite};
  } else if (entry.second.size() != groups) {
    entry = {opt, GroupLrs(*opt)};
  }
  return entry.second;
}

std::string Get(const SchedulerState& s, const std::string& key, const std::string& type) {
  auto it = s.find(key);
  ST_CHECK_ARG(it != s.end(), "scheduler state for ", type, " lacks the key '", key, "'");
  return it->second;
}

int64_t GetInt(const SchedulerState& s, const std::string& key, const std::string& type) {
  const std::string v = Get(s, key, type);
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  ST_CHECK_ARG(end && *end == '\0' && !v.empty(), "scheduler state for ", type, ": '", key, "' is '", v,
               "', not an integer");
  return x;
}

double GetDouble(const SchedulerState& s, const std::string& key, const std::string& type) {
  const std::string v = Get(s, key, type);
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  ST_CHECK_ARG(end && *end == '\0' && !v.empty(), "scheduler state for ", type, ": '", key, "' is '", v,
               "', not a number");
  return x;
}

}  // namespace internal

using internal::Get;
using internal::GetInt;
using internal::InitialLrs;
using internal::kPi;

// ---- helpers ------------------------------------------------------------------

std::string DoubleToString(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

std::string DoublesToString(const std::vector<double>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + DoubleToString(v[i]);
  return out;
}

std::vector<double> DoublesFromString(const std::string& s) {
  std::vector<double> out;
  if (s.empty()) return out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const double x = std::strtod(item.c_str(), &end);
    ST_CHECK_ARG(end && *end == '\0' && !item.empty(), "'", s, "' is not a comma-separated list of numbers");
    out.push_back(x);
  }
  return out;
}

std::vector<double> GroupLrs(const torch::optim::Optimizer& opt) {
  std::vector<double> out;
  for (const auto& g : opt.param_groups()) out.push_back(g.options().get_lr());
  return out;
}

void SetGroupLrs(torch::optim::Optimizer& opt, const std::vector<double>& lrs) {
  auto& groups = opt.param_groups();
  ST_CHECK_ARG(lrs.size() == groups.size(), "expected ", groups.size(), " learning rates (one per parameter group), got ",
               lrs.size());
  for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(lrs[g]);
}

namespace {

// A parameter group's momentum slot: SGD's momentum or Adam/AdamW's beta1.
double* MomentumOf(torch::optim::OptimizerOptions& o) {
  if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) return &std::get<0>(a->betas());
  if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) return &std::get<0>(w->betas());
  if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&o)) return &s->momentum();
  return nullptr;
}

}  // namespace

std::vector<double> GroupMomentums(const torch::optim::Optimizer& opt) {
  std::vector<double> out;
  for (const auto& g : opt.param_groups()) {
    double* m = MomentumOf(const_cast<torch::optim::OptimizerOptions&>(g.options()));
    if (!m) return {};
    out.push_back(*m);
  }
  return out;
}

void SetGroupMomentums(torch::optim::Optimizer& opt, const std::vector<double>& momentums) {
  if (momentums.empty()) return;
  auto& groups = opt.param_groups();
  ST_CHECK_ARG(momentums.size() == groups.size(), "expected ", groups.size(),
               " momentums (one per parameter group), got ", momentums.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    double* m = MomentumOf(groups[g].options());
    ST_CHECK_ARG(m != nullptr, "parameter group ", g, " has no momentum (SGD) or betas (Adam, AdamW)");
    *m = momentums[g];
  }
}

// ---- LRScheduler ------------------------------------------------------------------

LRScheduler::LRScheduler(OptimizerPtr optimizer) : optimizer_(std::move(optimizer)) {
  ST_CHECK_ARG(optimizer_ != nullptr, "a learning-rate scheduler needs an optimizer (got null)");
  base_lrs_ = InitialLrs(optimizer_, nullptr);
}

LRScheduler::~LRScheduler() = default;

void LRScheduler::InitialStep() {
  step_count_ = 0;
  is_initial_ = true;
  step();
  is_initial_ = false;
}

void LRScheduler::step() {
  ++step_count_;
  UpdateLr(std::nullopt);
}

void LRScheduler::step(double) {
  ST_THROW(InvalidArgumentError, name(), ".step takes no metric (only ReduceLROnPlateau does)");
}

void LRScheduler::UpdateLr(std::optional<int64_t> epoch) {
  std::vector<double> values;
  if (!epoch) {
    ++last_epoch_;
    values = ComputeLr();
  } else {
    last_epoch_ = *epoch;
    auto closed = ClosedFormLr();
    values = closed ? *closed : ComputeLr();
  }
  SetGroupLrs(*optimizer_, values);
  last_lr_ = trainer::GroupLrs(*optimizer_);
}

std::vector<double> LRScheduler::GroupLrs() const { return trainer::GroupLrs(*optimizer_); }

void LRScheduler::CheckType(const SchedulerState& state) const {
  auto it = state.find("type");
  ST_CHECK_ARG(it != state.end() && it->second == name(), "scheduler state is of ",
               it == state.end() ? std::string("no type") : it->second, ", but this scheduler is a ", name());
}

SchedulerState LRScheduler::state_dict() const {
  return {{"type", name()},
          {"last_epoch", std::to_string(last_epoch_)},
          {"_step_count", std::to_string(step_count_)},
          {"base_lrs", DoublesToString(base_lrs_)},
          {"_last_lr", DoublesToString(last_lr_)}};
}

void LRScheduler::load_state_dict(const SchedulerState& state) {
  CheckType(state);
  const std::string t = name();
  const int64_t last_epoch = GetInt(state, "last_epoch", t);
  const int64_t step_count = GetInt(state, "_step_count", t);
  const auto base = DoublesFromString(Get(state, "base_lrs", t));
  const auto last = DoublesFromString(Get(state, "_last_lr", t));
  const size_t groups = optimizer_->param_groups().size();
  ST_CHECK_ARG(base.size() == groups && last.size() == groups, "scheduler state for ", t, " has ", base.size(),
               " parameter groups, the optimizer ", groups);
  last_epoch_ = last_epoch;
  step_count_ = step_count;
  base_lrs_ = base;
  last_lr_ = last;
}

// ---- LambdaLR, StepLR, MultiStepLR -----------------------------------------------

LambdaLR::LambdaLR(OptimizerPtr optimizer, std::function<double(int64_t)> lr_lambda)
    : LRScheduler(std::move(optimizer)), lambda_(std::move(lr_lambda)) {
  ST_CHECK_ARG(lambda_ != nullptr, "LambdaLR: lr_lambda must be a function (got none)");
  InitialStep();
}

std::vector<double> LambdaLR::ComputeLr() {
  std::vector<double> out;
  for (double b : base_lrs_) out.push_back(b * lambda_(last_epoch_));
  return out;
}

StepLR::StepLR(OptimizerPtr optimizer, int64_t step_size, double gamma)
    : LRScheduler(std::move(optimizer)), step_size_(step_size), gamma_(gamma) {
  ST_CHECK_ARG(step_size_ > 0, "StepLR: step_size must be > 0, got ", step_size_);
  InitialStep();
}

std::vector<double> StepLR::ComputeLr() {
  auto lrs = GroupLrs();
  if (last_epoch_ == 0 || PyMod(last_epoch_, step_size_) != 0) return lrs;
  for (double& l : lrs) l *= gamma_;
  return lrs;
}

std::optional<std::vector<double>> StepLR::ClosedFormLr() {
  std::vector<double> out;
  const int64_t k = last_epoch_ >= 0 ? last_epoch_ / step_size_ : -((-last_epoch_ + step_size_ - 1) / step_size_);
  for (double b : base_lrs_) out.push_back(b * std::pow(gamma_, static_cast<double>(k)));
  return out;
}

MultiStepLR::MultiStepLR(OptimizerPtr optimizer, std::vector<int64_t> milestones, double gamma)
    : LRScheduler(std::move(optimizer)), milestones_(std::move(milestones)), gamma_(gamma) {
  std::sort(milestones_.begin(), milestones_.end());
  InitialStep();
}

std::vector<double> MultiStepLR::ComputeLr() {
  auto lrs = GroupLrs();
  const auto k = std::count(milestones_.begin(), milestones_.end(), last_epoch_);
  if (k == 0) return lrs;
  for (double& l : lrs) l *= std::pow(gamma_, static_cast<double>(k));
  return lrs;
}

std::optional<std::vector<double>> MultiStepLR::ClosedFormLr() {
  const auto k = std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin();
  std::vector<double> out;
  for (double b : base_lrs_) out.push_back(b * std::pow(gamma_, static_cast<double>(k)));
  return out;
}

// ---- CosineAnnealingLR, LinearLR ------------------------------------------------

CosineAnnealingLR::CosineAnnealingLR(OptimizerPtr optimizer, int64_t T_max, double eta_min)
    : LRScheduler(std::move(optimizer)), T_max_(T_max), eta_min_(eta_min) {
  ST_CHECK_ARG(T_max_ > 0, "CosineAnnealingLR: T_max must be > 0, got ", T_max_);
  InitialStep();
}

std::vector<double> CosineAnnealingLR::ComputeLr() {
  auto lrs = GroupLrs();
  if (is_initial_) return lrs;
  const double le = static_cast<double>(last_epoch_);
  const double T = static_cast<double>(T_max_);
  if (step_count_ == 1 && last_epoch_ > 0) {
    for (size_t g = 0; g < lrs.size(); ++g) {
      lrs[g] = eta_min_ + (base_lrs_[g] - eta_min_) * (1 + std::cos(le * kPi / T)) / 2;
    }
  } else if (PyMod(last_epoch_ - 1 - T_max_, 2 * T_max_) == 0) {
    for (size_t g = 0; g < lrs.size(); ++g) lrs[g] = lrs[g] + (base_lrs_[g] - eta_min_) * (1 - std::cos(kPi / T)) / 2;
  } else {
    for (double& l : lrs) {
      l = (1 + std::cos(kPi * le / T)) / (1 + std::cos(kPi * (le - 1) / T)) * (l - eta_min_) + eta_min_;
    }
  }
  return lrs;
}

std::optional<std::vector<double>> CosineAnnealingLR::ClosedFormLr() {
  std::vector<double> out;
  const double le = static_cast<double>(last_epoch_);
  for (double b : base_lrs_) out.push_back(eta_min_ + (b - eta_min_) * (1 + std::cos(kPi * le / T_max_)) / 2);
  return out;
}

LinearLR::LinearLR(OptimizerPtr optimizer, double start_factor, double end_factor, int64_t total_iters)
    : LRScheduler(std::move(optimizer)), start_factor_(start_factor), end_factor_(end_factor), total_iters_(total_iters) {
  ST_CHECK_ARG(start_factor_ > 0 && start_factor_ <= 1, "LinearLR: start_factor must be in (0, 1], got ",
               start_factor_);
  ST_CHECK_ARG(end_factor_ >= 0 && end_factor_ <= 1, "LinearLR: end_factor must be in [0, 1], got ", end_factor_);
  ST_CHECK_ARG(total_iters_ > 0, "LinearLR: total_iters must be > 0, got ", total_iters_);
  InitialStep();
}

std::vector<double> LinearLR::ComputeLr() {
  auto lrs = GroupLrs();
  if (last_epoch_ == 0) {
    for (double& l : lrs) l *= start_factor_;
    return lrs;
  }
  if (is_initial_ || last_epoch_ > total_iters_) return lrs;
  const double d = end_factor_ - start_factor_;
  for (double& l : lrs) {
    l = l * (1.0 + d / (static_cast<double>(total_iters_) * start_factor_ + static_cast<double>(last_epoch_ - 1) * d));
  }
  return lrs;
}

std::optional<std::vector<double>> LinearLR::ClosedFormLr() {
  std::vector<double> out;
  const double n = static_cast<double>(std::min(total_iters_, last_epoch_));
  for (double b : base_lrs_) {
    out.push_back(b * (start_factor_ + (end_factor_ - start_factor_) * n / static_cast<double>(total_iters_)));
  }
  return out;
}

}  // namespace shardtrain::trainer
