// Shared by the fault tests (header only, like tests/trainer/fixtures.h): a
// tiny classifier with two wrap points and a hook at each point where a test
// may inject a fault: "forward" (between the two units' forwards), "backward"
// (between the two units' backwards), "optimizer" (inside optimizer.step) and
// "save" (inside a checkpoint save, after the full state was gathered and
// before the file is renamed into place; for sharded saves, before the
// rank files are written). Options make the loss NaN at one step on one rank.
#ifndef SHARDTRAIN_TESTS_FAULTS_TINY_MODEL_H_
#define SHARDTRAIN_TESTS_FAULTS_TINY_MODEL_H_

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sharding/wrap_point.h"
#include "trainer/callbacks/callback.h"
#include "trainer/data/data.h"
#include "trainer/trainer.h"
#include "trainer/training_module.h"

namespace shardtrain::faults {

// Called with (point, rank, global step) at each injection point.
using FaultHook = std::function<void(const std::string& point, int rank, int64_t step)>;

// Parameters are drawn from `g` (x0.3, registration order) inside the
// constructors: sharded construction keeps only this rank's shard of a wrap
// point once it is built.
inline void DrawTinyParameters(torch::nn::Module& m, at::Generator& g) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.copy_(at::randn(p.sizes(), g) * 0.3);
}

class TinyBlockImpl : public torch::nn::Module {
 public:
  TinyBlockImpl(int64_t in, int64_t out, at::Generator& g) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    DrawTinyParameters(*this, g);
  }
  at::Tensor forward(const at::Tensor& x) { return at::relu(fc->forward(x)); }
  torch::nn::Linear fc{nullptr};
};

class TinyNetImpl : public torch::nn::Module {
 public:
  explicit TinyNetImpl(at::Generator& g) {
    b1 = register_module("b1", std::make_shared<sharding::Sharded<TinyBlockImpl>>(8, 16, g));
    b2 = register_module("b2", std::make_shared<sharding::Sharded<TinyBlockImpl>>(16, 16, g));
    head = register_module("head", torch::nn::Linear(16, 3));
    DrawTinyParameters(*head, g);
  }
  std::shared_ptr<sharding::Sharded<TinyBlockImpl>> b1, b2;
  torch::nn::Linear head{nullptr};
};

// Learnable: the class is the argmax of the first three features.
inline std::shared_ptr<trainer::TensorDataset> TinyData(int64_t n, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  at::Tensor x = at::randn({n, 8}, g);
  return std::make_shared<trainer::TensorDataset>(x, x.slice(1, 0, 3).argmax(1));
}

// Adam whose step() first calls the hook.
class HookedAdam : public torch::optim::Adam {
 public:
  HookedAdam(const std::vector<at::Tensor>& params, std::function<void()> before_step)
      : torch::optim::Adam(params, torch::optim::AdamOptions(2e-2)), before_step_(std::move(before_step)) {}
  at::Tensor step(LossClosure closure = nullptr) override {
    before_step_();
    return torch::optim::Adam::step(std::move(closure));
  }

 private:
  std::function<void()> before_step_;
};

class TinyModule : public trainer::TrainingModule {
 public:
  FaultHook hook;           // may be empty
  int64_t nan_step = -1;    // training_step at this global step returns loss * NaN ...
  int nan_rank = -1;        // ... on this rank

  std::shared_ptr<torch::nn::Module> configure_model() override {
    auto g = at::detail::createCPUGenerator(7);
    net_ = std::make_shared<TinyNetImpl>(g);
    return net_;
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    const int rank = trainer().rank();
    const int64_t step = trainer().global_step();
    at::Tensor out = forward([&] {
      at::Tensor h = net_->b1->forward(b.inputs);
      Call("forward", rank, step);
      if (h.requires_grad()) h.register_hook([this, rank, step](const at::Tensor&) { Call("backward", rank, step); });
      return net_->head->forward(net_->b2->forward(h));
    });
    at::Tensor loss = at::cross_entropy_loss(out, b.targets);
    if (step == nan_step && rank == nan_rank) loss = loss * std::numeric_limits<double>::quiet_NaN();
    return loss;
  }
  trainer::OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    trainer::OptimizerConfig c;
    trainer::Trainer* t = &trainer();
    c.optimizer = std::make_shared<HookedAdam>(params, [this, t] { Call("optimizer", t->rank(), t->global_step()); });
    return c;
  }
  void Call(const std::string& point, int rank, int64_t step) {
    if (hook) hook(point, rank, step);
  }
  std::shared_ptr<TinyNetImpl> net_;
};

// Calls the module's hook with "save" while a checkpoint is being saved (the
// Trainer asks every rank for its callbacks' states during each save).
class SaveHook : public trainer::Callback {
 public:
  explicit SaveHook(TinyModule* module) : module_(module) {}
  void on_fit_start(trainer::Trainer& t, trainer::TrainingModule&) override { trainer_ = &t; }
  std::string state_key() const override { return "SaveHook"; }
  std::map<std::string, std::string> state_dict() const override {
    if (trainer_) module_->Call("save", trainer_->rank(), trainer_->global_step());
    return {};
  }

 private:
  TinyModule* module_;
  trainer::Trainer* trainer_ = nullptr;
};

}  // namespace shardtrain::faults

#endif  // SHARDTRAIN_TESTS_FAULTS_TINY_MODEL_H_
