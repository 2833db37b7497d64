// Prints the learning rates (and momentums) of trainer/optim/lr_scheduler.h's
// schedulers over 50 steps, one line per step: "<case> <step> <values...>",
// doubles as %.17g. lr_scheduler_check.py builds the same cases with Python's
// torch.optim.lr_scheduler and compares (lr_scheduler_python_test).
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "trainer/optim/lr_scheduler.h"

using namespace shardtrain::trainer;

namespace {

constexpr int kSteps = 50;

// Two parameter groups (lr 0.1 and 0.05), as the Python side builds them.
std::shared_ptr<torch::optim::Optimizer> Sgd() {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({2})},
                      std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1).momentum(0.9)));
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({3})},
                      std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.05).momentum(0.9)));
  return std::make_shared<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(0.1).momentum(0.9));
}

std::shared_ptr<torch::optim::Optimizer> Adam() {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({2})},
                      std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(0.1)));
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({3})},
                      std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(0.05)));
  return std::make_shared<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(0.1));
}

void Print(const std::string& name, int step, const torch::optim::Optimizer& opt) {
  std::printf("%s %d", name.c_str(), step);
  for (double v : GroupLrs(opt)) std::printf(" %.17g", v);
  for (double v : GroupMomentums(opt)) std::printf(" %.17g", v);
  std::printf("\n");
}

// Runs `step` kSteps times after construction, printing before each.
void Run(const std::string& name, const std::shared_ptr<torch::optim::Optimizer>& opt,
         const std::function<void(int)>& step) {
  for (int i = 0; i <= kSteps; ++i) {
    Print(name, i, *opt);
    if (i < kSteps) step(i);
  }
}

// The metric ReduceLROnPlateau sees at step i (plateaus and improvements).
double Metric(int i) { return 1.0 / (1 + i / 6) + 0.01 * ((i * 7) % 3); }

}  // namespace

int main() {
  {
    auto o = Sgd();
    auto s = std::make_shared<StepLR>(o, 7, 0.5);
    Run("step", o, [&](int) { s->step(); });
  }
  {
    auto o = Sgd();
    auto s = std::make_shared<MultiStepLR>(o, std::vector<int64_t>{30, 5, 12, 12}, 0.3);
    Run("multistep", o, [&](int) { s->step(); });
  }
  {
    auto o = Sgd();
    auto s = std::make_shared<CosineAnnealingLR>(o, 20, 0.001);
    Run("cosine", o, [&](int) { s->step(); });
  }
  {
    auto o = Sgd();
    auto s = std::make_shared<LinearLR>(o, 0.1, 1.0, 10);
    Run("linear", o, [&](int) { s->step(); });
  }
  {
    auto o = Sgd();
    auto s = std::make_shared<LambdaLR>(o, [](int64_t e) { return 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, e / 40.0))); });
    Run("lambda", o, [&](int) { s->step(); });
  }
  {
    auto o = Adam();
    auto warm = std::make_shared<LinearLR>(o, 0.01, 1.0, 5);
    auto cos = std::make_shared<CosineAnnealingLR>(o, 45, 1e-4);
    auto s = std::make_shared<SequentialLR>(o, std::vector<LRSchedulerPtr>{warm, cos}, std::vector<int64_t>{5});
    Run("warmup_cosine", o, [&](int) { s->step(); });
  }
  {
    auto o = Sgd();
    auto a = std::make_shared<StepLR>(o, 10, 0.5);
    auto b = std::make_shared<CosineAnnealingLR>(o, 25, 0.0);
    Run("chained", o, [&](int) {
      a->step();
      b->step();
    });
  }
  {
    auto o = Sgd();
    OneCycleOptions oc;
    oc.max_lr = 1.0;
    oc.total_steps = kSteps;
    auto s = std::make_shared<OneCycleLR>(o, oc);
    Run("onecycle", o, [&](int) { s->step(); });
  }
  {
    auto o = Adam();
    OneCycleOptions oc;
    oc.max_lr = 0.5;
    oc.total_steps = 60;
    oc.pct_start = 0.25;
    oc.anneal_strategy = "linear";
    oc.three_phase = true;
    oc.div_factor = 10;
    oc.final_div_factor = 100;
    auto s = std::make_shared<OneCycleLR>(o, oc);
    Run("onecycle3", o, [&](int) { s->step(); });
  }
  {
    auto o = Sgd();
    ReduceLROnPlateauOptions p;
    p.patience = 2;
    p.cooldown = 1;
    p.factor = 0.5;
    p.min_lr = 0.002;
    auto s = std::make_shared<ReduceLROnPlateau>(o, p);
    Run("plateau_min", o, [&](int i) { s->step(Metric(i)); });
  }
  {
    auto o = Sgd();
    ReduceLROnPlateauOptions p;
    p.mode = "max";
    p.threshold_mode = "abs";
    p.threshold = 0.05;
    p.patience = 1;
    p.factor = 0.3;
    auto s = std::make_shared<ReduceLROnPlateau>(o, p);
    Run("plateau_max", o, [&](int i) { s->step(-Metric(i)); });
  }
  return 0;
}
