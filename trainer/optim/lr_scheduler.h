// Learning-rate schedulers: PyTorch's torch.optim.lr_scheduler for LibTorch
// optimizers, with the same formulas (the chainable forms PyTorch's step()
// uses, so several schedulers on one optimizer compose as in PyTorch), the
// same construction semantics (constructing a scheduler sets the optimizer's
// learning rates for step 0) and state_dict/load_state_dict for checkpoints.
//
//   auto opt = std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-3));
//   auto warmup = std::make_shared<LinearLR>(opt, /*start_factor=*/0.01, 1.0, /*total_iters=*/100);
//   auto cosine = std::make_shared<CosineAnnealingLR>(opt, /*T_max=*/900, /*eta_min=*/1e-5);
//   OptimizerConfig c{opt};
//   c.lr_schedulers = {{std::make_shared<SequentialLR>(opt, {warmup, cosine}, {100}), "step"}};
//
// The Trainer steps each LRSchedulerConfig (Lightning's lr scheduler dict) at
// its interval (trainer/trainer.h "Learning-rate schedulers"); a program
// without the Trainer calls step() after optimizer.step() as in PyTorch.
// Tested against Python's torch.optim.lr_scheduler (tests/trainer
// lr_scheduler_python_test: every scheduler's lrs over 50 steps within 1e-12).
#ifndef SHARDTRAIN_TRAINER_OPTIM_LR_SCHEDULER_H_
#define SHARDTRAIN_TRAINER_OPTIM_LR_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer {

using OptimizerPtr = std::shared_ptr<torch::optim::Optimizer>;

// A scheduler's state as strings (doubles printed so that they read back
// bit for bit), stored in checkpoints under "lr_schedulers".
using SchedulerState = std::map<std::string, std::string>;

// PyTorch's LRScheduler. Subclasses set the optimizer's lr of every
// parameter group on construction (step 0) and on each step().
class LRScheduler {
 public:
  virtual ~LRScheduler();
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Class name as in PyTorch ("StepLR", "CosineAnnealingLR", ...).
  virtual std::string name() const = 0;
  // One epoch or step on (call after optimizer.step()).
  virtual void step();
  // ReduceLROnPlateau's step(metrics); the others throw InvalidArgumentError.
  virtual void step(double metric);
  // Whether step needs the monitored metric (ReduceLROnPlateau).
  virtual bool needs_metric() const { return false; }
  // The lrs this scheduler set last, one per parameter group.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_epoch() const { return last_epoch_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  const OptimizerPtr& optimizer_ptr() const { return optimizer_; }

  // The mutable state (PyTorch's state_dict without the hyperparameters,
  // which come from the code that builds the scheduler) plus "type".
  virtual SchedulerState state_dict() const;
  // Throws InvalidArgumentError naming the key when `state` is of another
  // scheduler type or lacks a key; changes nothing then.
  virtual void load_state_dict(const SchedulerState& state);

 protected:
  // Registers the optimizer's initial lrs (PyTorch's param_group
  // "initial_lr": set by the first scheduler of an optimizer, shared by
  // later ones) as base_lrs.
  explicit LRScheduler(OptimizerPtr optimizer);
  // PyTorch's _initial_step: the subclass constructor's last call.
  void InitialStep();
  // The next lrs (PyTorch's get_lr, the chainable form); last_epoch_ is already advanced.
  virtual std::vector<double> ComputeLr() = 0;
  // PyTorch's _get_closed_form_lr, where it exists (used by SequentialLR at milestones).
  virtual std::optional<std::vector<double>> ClosedFormLr() { return std::nullopt; }
  // PyTorch's _update_lr(epoch).
  void UpdateLr(std::optional<int64_t> epoch);
  std::vector<double> GroupLrs() const;
  void CheckType(const SchedulerState& state) const;

  OptimizerPtr optimizer_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  int64_t last_epoch_ = -1;
  int64_t step_count_ = 0;
  bool is_initial_ = false;

 private:
  friend class SequentialLR;
};

using LRSchedulerPtr = std::shared_ptr<LRScheduler>;

// lr = base_lr * lr_lambda(last_epoch).
class LambdaLR final : public LRScheduler {
 public:
  LambdaLR(OptimizerPtr optimizer, std::function<double(int64_t)> lr_lambda);
  std::string name() const override { return "LambdaLR"; }

 private:
  std::vector<double> ComputeLr() override;
  std::function<double(int64_t)> lambda_;
};

// lr *= gamma every step_size steps.
class StepLR final : public LRScheduler {
 public:
  StepLR(OptimizerPtr optimizer, int64_t step_size, double gamma = 0.1);
  std::string name() const override { return "StepLR"; }

 private:
  std::vector<double> ComputeLr() override;
  std::optional<std::vector<double>> ClosedFormLr() override;
  int64_t step_size_;
  double gamma_;
};

// lr *= gamma at each milestone (a milestone given k times: gamma^k).
class MultiStepLR final : public LRScheduler {
 public:
  MultiStepLR(OptimizerPtr optimizer, std::vector<int64_t> milestones, double gamma = 0.1);
  std::string name() const override { return "MultiStepLR"; }

 private:
  std::vector<double> ComputeLr() override;
  std::optional<std::vector<double>> ClosedFormLr() override;
  std::vector<int64_t> milestones_;  // sorted
  double gamma_;
};

// Cosine from base_lr down to eta_min over T_max steps (and back up after,
// as PyTorch's).
class CosineAnnealingLR final : public LRScheduler {
 public:
  CosineAnnealingLR(OptimizerPtr optimizer, int64_t T_max, double eta_min = 0.0);
  std::string name() const override { return "CosineAnnealingLR"; }

 private:
  std::vector<double> ComputeLr() override;
  std::optional<std::vector<double>> ClosedFormLr() override;
  int64_t T_max_;
  double eta_min_;
};

// Linear warmup (or decay): the factor goes from start_factor to end_factor
// over total_iters steps, then stays.
class LinearLR final : public LRScheduler {
 public:
  LinearLR(OptimizerPtr optimizer, double start_factor = 1.0 / 3, double end_factor = 1.0, int64_t total_iters = 5);
  std::string name() const override { return "LinearLR"; }

 private:
  std::vector<double> ComputeLr() override;
  std::optional<std::vector<double>> ClosedFormLr() override;
  double start_factor_;
  double end_factor_;
  int64_t total_iters_;
};

// Runs schedulers one after the other: schedulers[i] from milestones[i-1]
// on (e.g. LinearLR warmup, then CosineAnnealingLR). All on one optimizer;
// not ReduceLROnPlateau. Its state holds the children's ("<i>.<key>").
class SequentialLR final : public LRScheduler {
 public:
  SequentialLR(OptimizerPtr optimizer, std::vector<LRSchedulerPtr> schedulers, std::vector<int64_t> milestones);
  std::string name() const override { return "SequentialLR"; }
  void step() override;
  SchedulerState state_dict() const override;
  void load_state_dict(const SchedulerState& state) override;

 private:
  std::vector<double> ComputeLr() override;
  static void RecursiveUndo(LRScheduler& s);
  std::vector<LRSchedulerPtr> schedulers_;
  std::vector<int64_t> milestones_;
};

struct OneCycleOptions {
  double max_lr = 0;  // required (> 0); the same for every parameter group
  int64_t total_steps = 0;  // required (> 0): the steps of the cycle (e.g. trainer().estimated_stepping_batches())
  double pct_start = 0.3;
  std::string anneal_strategy = "cos";  // "cos" or "linear"
  // Cycle momentum (SGD) or beta1 (Adam, AdamW) inversely to the lr.
  bool cycle_momentum = true;
  double base_momentum = 0.85;
  double max_momentum = 0.95;
  double div_factor = 25.0;          // initial lr = max_lr / div_factor
  double final_div_factor = 1e4;     // min lr = initial lr / final_div_factor
  bool three_phase = false;
};

// The 1cycle policy (stepped every optimizer step); stepping past
// total_steps throws, as PyTorch's.
class OneCycleLR final : public LRScheduler {
 public:
  OneCycleLR(OptimizerPtr optimizer, OneCycleOptions options);
  std::string name() const override { return "OneCycleLR"; }

 private:
  struct Phase {
    double end_step;
    int start_lr, end_lr, start_m, end_m;  // 0 initial/max momentum, 1 max_lr/base momentum, 2 min_lr
  };
  std::vector<double> ComputeLr() override;
  double Anneal(double start, double end, double pct) const;
  OneCycleOptions o_;
  std::vector<Phase> phases_;
  double initial_lr_, min_lr_;
};

struct ReduceLROnPlateauOptions {
  std::string mode = "min";  // "min" or "max"
  double factor = 0.1;       // new lr = lr * factor (< 1)
  int64_t patience = 10;
  double threshold = 1e-4;
  std::string threshold_mode = "rel";  // "rel" or "abs"
  int64_t cooldown = 0;
  double min_lr = 0;
  double eps = 1e-8;  // lr changes smaller than this are ignored
};

// Reduces the lr when a metric stopped improving; step(metric). The Trainer
// passes the metric named by LRSchedulerConfig::monitor.
class ReduceLROnPlateau final : public LRScheduler {
 public:
  ReduceLROnPlateau(OptimizerPtr optimizer, ReduceLROnPlateauOptions options = {});
  std::string name() const override { return "ReduceLROnPlateau"; }
  void step() override;  // throws: needs the metric
  void step(double metric) override;
  bool needs_metric() const override { return true; }
  SchedulerState state_dict() const override;
  void load_state_dict(const SchedulerState& state) override;
  double best() const { return best_; }
  int64_t num_bad_epochs() const { return num_bad_epochs_; }

 private:
  std::vector<double> ComputeLr() override;
  bool IsBetter(double a, double best) const;
  ReduceLROnPlateauOptions o_;
  double best_;
  int64_t num_bad_epochs_ = 0;
  int64_t cooldown_counter_ = 0;
};

// Lightning's lr scheduler dict: what the Trainer steps and when.
struct LRSchedulerConfig {
  LRSchedulerPtr scheduler;
  // "step": after every `frequency` optimizer steps (global step % frequency
  // == 0); "epoch" (Lightning's default): at the end of every `frequency` epochs.
  std::string interval = "epoch";
  int64_t frequency = 1;
  // ReduceLROnPlateau: the metric (Trainer::callback_metrics: val_loss,
  // train_loss, what the module log()s) passed to step(metric).
  std::string monitor = "val_loss";
  // A missing monitored metric is an error (else the step is skipped, with a warning).
  bool strict = true;
  // Name for LearningRateMonitor ("" = "lr-<Optimizer>").
  std::string name;
};

// The optimizer's lr and momentum (SGD momentum, Adam/AdamW beta1) per
// parameter group; SetGroupLrs / SetGroupMomentums restore them (checkpoints).
// Momentums are empty for optimizers without one.
std::vector<double> GroupLrs(const torch::optim::Optimizer& opt);
std::vector<double> GroupMomentums(const torch::optim::Optimizer& opt);
void SetGroupLrs(torch::optim::Optimizer& opt, const std::vector<double>& lrs);
void SetGroupMomentums(torch::optim::Optimizer& opt, const std::vector<double>& momentums);

// Exact text forms of doubles and lists of them (for SchedulerState).
std::string DoubleToString(double v);
std::string DoublesToString(const std::vector<double>& v);
std::vector<double> DoublesFromString(const std::string& s);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_OPTIM_LR_SCHEDULER_H_
