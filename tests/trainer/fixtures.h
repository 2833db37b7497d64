// Shared by the trainer tests and fixture binaries (header only: no extra
// translation unit to compile): a small classifier with two wrap points, a
// learnable synthetic data set, and a threads-as-ranks Fit.
#ifndef SHARDTRAIN_TESTS_TRAINER_FIXTURES_H_
#define SHARDTRAIN_TESTS_TRAINER_FIXTURES_H_

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "sharding/wrap_point.h"
#include "tests/testing/multi_rank.h"
#include "trainer/data/data.h"
#include "trainer/trainer.h"
#include "trainer/training_module.h"

namespace shardtrain::trainer::fixtures {
namespace fs = std::filesystem;

inline std::string TmpDir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  fs::path p = fs::path(t ? t : "/tmp") / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// Draws a module's parameters (registration order) from `g` times `scale`;
// nothing without a generator. Called inside constructors, so that a wrapped
// module is initialised before sharded construction keeps only its shard.
inline void DrawParameters(torch::nn::Module& m, at::Generator* g, double scale) {
  if (g == nullptr) return;
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.copy_(at::randn(p.sizes(), *g) * scale);
}

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t in, int64_t out, at::Generator* g = nullptr, double scale = 0.3) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    DrawParameters(*this, g, scale);
  }
  at::Tensor forward(const at::Tensor& x) { return at::relu(fc->forward(x)); }
  torch::nn::Linear fc{nullptr};
};

class NetImpl : public torch::nn::Module {
 public:
  // With a generator, every parameter is drawn from it in registration order.
  explicit NetImpl(int64_t classes = 3, at::Generator* g = nullptr) {
    b1 = register_module("b1", std::make_shared<sharding::Sharded<BlockImpl>>(8, 16, g));
    b2 = register_module("b2", std::make_shared<sharding::Sharded<BlockImpl>>(16, 16, g));
    head = register_module("head", torch::nn::Linear(16, classes));
    DrawParameters(*head, g, 0.3);
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(b2->forward(b1->forward(x))); }
  std::shared_ptr<sharding::Sharded<BlockImpl>> b1, b2;
  torch::nn::Linear head{nullptr};
};

// Learnable: the class is the argmax of the first three features.
inline std::shared_ptr<TensorDataset> MakeData(int64_t n, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  at::Tensor x = at::randn({n, 8}, g);
  return std::make_shared<TensorDataset>(x, x.slice(1, 0, 3).argmax(1));
}

struct ClassifierConfig {
  std::string optimizer = "adam";  // adam, adamw, sgd (momentum 0.9), rmsprop
  bool lr_schedule = true;
  int64_t classes = 3;
  bool log_accuracy = false;        // log("acc", ...) in training_step
  bool constant_val_loss = false;   // validation_step returns 1.0 (never improves)
  // configure_optimizers ignores its `params` and uses the module's own
  // parameters (wrong for sharded strategies: they train shards).
  bool optimizer_over_module_parameters = false;
};

class Classifier : public TrainingModule {
 public:
  explicit Classifier(ClassifierConfig c = {}) : c_(std::move(c)) {}
  std::shared_ptr<torch::nn::Module> configure_model() override {
    // Threads-as-ranks share the global generator, so initialize from our own,
    // inside the constructors (sharded construction keeps only shards).
    auto g = at::detail::createCPUGenerator(7);
    net_ = std::make_shared<NetImpl>(c_.classes, &g);
    return net_;
  }
  at::Tensor training_step(const Batch& b, int64_t) override {
    at::Tensor out = forward([&] { return net_->forward(b.inputs); });
    if (c_.log_accuracy) log("acc", out.argmax(1).eq(b.targets).to(at::kFloat).mean().item<double>());
    return at::cross_entropy_loss(out.to(at::kFloat), b.targets);
  }
  std::optional<at::Tensor> validation_step(const Batch& b, int64_t i) override {
    if (c_.constant_val_loss) return at::ones({}, at::kFloat);
    at::Tensor out = forward([&] { return net_->forward(b.inputs); });
    return at::cross_entropy_loss(out.to(at::kFloat), b.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& given) override {
    const std::vector<at::Tensor> params = c_.optimizer_over_module_parameters ? net_->parameters() : given;
    OptimizerConfig c;
    if (c_.optimizer == "adamw") {
      c.optimizer = std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(2e-2).weight_decay(0.1));
    } else if (c_.optimizer == "rmsprop") {
      c.optimizer = std::make_shared<torch::optim::RMSprop>(params, torch::optim::RMSpropOptions(1e-2));
    } else if (c_.optimizer == "sgd") {
      c.optimizer = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    } else {
      c.optimizer = std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(2e-2));
    }
    if (c_.lr_schedule) c.lr_lambda = [](int64_t step) { return 1.0 / (1.0 + 0.05 * step); };
    return c;
  }
  std::map<std::string, std::string> hparams() const override { return {{"model", "mlp"}, {"lr", "0.02"}}; }
  void on_fit_start() override { ++fit_starts; }
  int fit_starts = 0;
  ClassifierConfig c_;
  std::shared_ptr<NetImpl> net_;
};

struct FitResult {
  std::vector<double> losses;
  std::vector<double> val_losses;
  std::string last_ckpt;
  std::string log_dir;
  std::string ckpt_dir;
  int64_t global_step = 0;
  int64_t epoch = 0;
};

// `after(rank, trainer, module)` runs on every rank after Fit (collectives allowed).
using AfterFit = std::function<void(int rank, Trainer& trainer, Classifier& module)>;
// Callbacks of one rank. Threads-as-ranks need one set per rank, as separate
// processes would have (o.callbacks would be shared by the threads).
using MakeCallbacks = std::function<std::vector<CallbackPtr>(int rank)>;

inline FitResult Fit(int world, const TrainerOptions& o, const std::string& ckpt_path = "", ClassifierConfig c = {},
                     const AfterFit& after = nullptr, const MakeCallbacks& callbacks = nullptr) {
  auto train = MakeData(64, 1);
  auto val = MakeData(16, 2);
  FitResult result;
  std::mutex mu;
  shardtrain::testing::RunRanks(world, [&](int rank, const auto& comm) {
    Classifier module(c);
    TrainerOptions mine = o;
    if (callbacks) mine.callbacks = callbacks(rank);
    Trainer trainer(mine, comm);
    trainer.Fit(module, *train, val.get(), ckpt_path);
    if (after) after(rank, trainer, module);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result.losses = trainer.step_losses();
      result.val_losses = trainer.val_losses();
      result.last_ckpt = trainer.last_checkpoint_path();
      result.log_dir = trainer.log_dir();
      result.ckpt_dir = trainer.checkpoint_dir();
      result.global_step = trainer.global_step();
      result.epoch = trainer.current_epoch();
    }
  });
  return result;
}

// 3 epochs of 4 optimizer steps: 64 samples, a global batch of 16 at any world size.
inline TrainerOptions BaseOptions(const std::string& root, int world) {
  TrainerOptions o;
  o.default_root_dir = root;
  o.max_epochs = 3;
  o.batch_size = 16 / world;
  o.log_every_n_steps = 1;
  o.enable_progress_bar = false;
  o.seed = 3;
  return o;
}

}  // namespace shardtrain::trainer::fixtures

#endif  // SHARDTRAIN_TESTS_TRAINER_FIXTURES_H_
