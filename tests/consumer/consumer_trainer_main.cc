// //tests/consumer:fsdp_native_only_test: a program that links
// //strategies/fsdp_native and //trainer and nothing of strategies/fsdp (its
// deps; consumer_test.sh checks the same graph from another workspace with
// `bazel query` and analyses it there). It checks that fsdp_native is
// registered and fsdp is not, then fits a small classifier on one process with
// fsdp_native and sharded checkpoints, and prints the first and last loss.
#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "strategies/registry.h"
#include "trainer/trainer.h"

namespace {
using namespace shardtrain;

class Linear : public trainer::TrainingModule {
 public:
  std::shared_ptr<torch::nn::Module> configure_model() override {
    net_ = torch::nn::Linear(4, 2);
    return net_.ptr();
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    at::Tensor out = forward([&] { return net_->forward(b.inputs); });
    return at::cross_entropy_loss(out, b.targets);
  }
  trainer::OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    return {std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(5e-2))};
  }
  torch::nn::Linear net_{nullptr};
};
}  // namespace

int main() {
  const char* test_tmpdir = std::getenv("TEST_TMPDIR");
  const std::filesystem::path tmp =
      test_tmpdir != nullptr ? std::filesystem::path(test_tmpdir) : std::filesystem::temp_directory_path();
  const std::string root = (tmp / "consumer_trainer").string();
  std::string names;
  for (const auto& n : strategies::StrategyRegistry::Names()) names += " " + n;
  if (!strategies::StrategyRegistry::Has("fsdp_native") || strategies::StrategyRegistry::Has("fsdp")) {
    std::cerr << "consumer_trainer: unexpected strategies:" << names << std::endl;
    return 1;
  }
  at::manual_seed(0);
  at::Tensor x = at::randn({64, 4});
  trainer::TensorDataset data(x, x.slice(1, 0, 2).argmax(1));
  trainer::TrainerOptions o;
  o.strategy = "fsdp_native";
  o.strategy_options = {{"state_dict_type", "sharded"}};
  o.max_epochs = 5;
  o.batch_size = 16;
  o.default_root_dir = root;
  o.enable_progress_bar = false;
  Linear module;
  trainer::Trainer t(o);
  t.Fit(module, data);
  const auto& l = t.step_losses();
  const bool sharded = std::filesystem::is_directory(t.last_checkpoint_path());
  std::cout << "consumer_trainer: strategies" << names << "; fsdp_native fit " << l.size() << " steps, loss "
            << l.front() << " -> " << l.back() << (sharded ? ", sharded checkpoint" : ", full checkpoint")
            << std::endl;
  return l.back() < l.front() && sharded ? 0 : 1;
}
