// SyncBatchNorm (trainer/plugins/sync_batchnorm.h) at W=2 threads-as-ranks against
// one process normalizing the concatenated batch: the layer alone (outputs,
// input and parameter gradients, running statistics, eval mode) and a conv +
// BatchNorm model trained by the Trainer with sync_batchnorm; without it the
// ranks' statistics differ (why the option exists); a model whose forward
// bypasses the module tree is a clear error.
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <map>
#include <mutex>

#include "base/errors.h"
#include "tests/testing/multi_rank.h"
#include "trainer/data/data.h"
#include "trainer/plugins/sync_batchnorm.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace {

double MaxDiff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

struct BnHolderImpl : torch::nn::Module {
  BnHolderImpl() { bn = register_module("bn", torch::nn::BatchNorm2d(3)); }
  torch::nn::BatchNorm2d bn{nullptr};
};

// The layer's reference: one process, the whole batch.
struct Reference {
  at::Tensor y, dx, dw, db, running_mean, running_var, y_eval;
};

TEST(SyncBatchNorm, LayerMatchesOneProcessOnTheConcatenatedBatch) {
  auto g = at::detail::createCPUGenerator(11);
  // Rank 1's half is shifted: its local statistics differ from the global ones.
  at::Tensor x = at::randn({8, 3, 5, 5}, g) * 2 + 1;
  x.slice(0, 4, 8).add_(3);
  const at::Tensor dy = at::randn({8, 3, 5, 5}, g);
  const at::Tensor w0 = at::rand({3}, g) + 0.5, b0 = at::randn({3}, g);
  const at::Tensor probe = at::randn({2, 3, 5, 5}, g);
  auto init = [&](torch::nn::BatchNorm2d& bn) {
    at::NoGradGuard no_grad;
    bn->weight.copy_(w0);
    bn->bias.copy_(b0);
  };
  Reference ref;
  {
    torch::nn::BatchNorm2d bn(3);
    init(bn);
    at::Tensor xr = x.clone().requires_grad_();
    ref.y = bn->forward(xr);
    (ref.y * dy).sum().backward();
    ref.dx = xr.grad();
    ref.dw = bn->weight.grad();
    ref.db = bn->bias.grad();
    ref.running_mean = bn->running_mean.clone();
    ref.running_var = bn->running_var.clone();
    bn->eval();
    ref.y_eval = bn->forward(probe).detach();
  }
  for (bool sync : {true, false}) {
    std::map<int, double> diff_y;
    std::mutex mu;
    shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
      auto holder = std::make_shared<BnHolderImpl>();
      init(holder->bn);
      if (sync) {
        const auto conversion = ConvertSyncBatchNorm(*holder, comm);
        ASSERT_EQ(conversion.layers(), std::vector<std::string>{"bn"});
      }
      const auto rows = at::indexing::Slice(4 * rank, 4 * rank + 4);
      at::Tensor xr = x.index({rows}).clone().requires_grad_();
      at::Tensor y = ForwardBatchNorm(*holder, "bn", xr);
      (y * dy.index({rows})).sum().backward();
      {
        std::lock_guard<std::mutex> lock(mu);
        diff_y[rank] = MaxDiff(y, ref.y.index({rows}));
      }
      if (!sync) return;
      EXPECT_LT(MaxDiff(y, ref.y.index({rows})), 1e-6) << "rank " << rank;
      EXPECT_LT(MaxDiff(xr.grad(), ref.dx.index({rows})), 1e-6) << "rank " << rank;
      // Parameter gradients are this rank's share: their sum over ranks is the whole batch's.
      auto params = holder->named_parameters();
      at::Tensor grads = at::cat({params["bn.weight"].grad(), params["bn.bias"].grad()});
      comm->AllReduce(grads)->Wait();
      EXPECT_LT(MaxDiff(grads, at::cat({ref.dw, ref.db})), 1e-5) << "rank " << rank;
      auto buffers = holder->named_buffers();
      EXPECT_LT(MaxDiff(buffers["bn.running_mean"], ref.running_mean), 1e-6) << "rank " << rank;
      EXPECT_LT(MaxDiff(buffers["bn.running_var"], ref.running_var), 1e-6) << "rank " << rank;
      EXPECT_EQ(buffers["bn.num_batches_tracked"].item<int64_t>(), 1);
      holder->eval();  // running statistics, no communication
      EXPECT_LT(MaxDiff(ForwardBatchNorm(*holder, "bn", probe), ref.y_eval), 1e-6) << "rank " << rank;
    });
    if (!sync) {
      // Each rank normalizing its own half: far from the whole batch's result.
      EXPECT_GT(diff_y[0], 0.1);
      EXPECT_GT(diff_y[1], 0.1);
    }
  }
}

// conv -> BatchNorm (through the tree, or through the typed member) -> ReLU -> mean -> linear.
class ConvBnImpl : public torch::nn::Module {
 public:
  explicit ConvBnImpl(bool typed_call) : typed_call_(typed_call) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    fc = register_module("fc", torch::nn::Linear(4, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = conv->forward(x);
    h = typed_call_ ? bn->forward(h) : ForwardBatchNorm(*this, "bn", h);
    return fc->forward(at::relu(h).mean({2, 3}));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};

 private:
  bool typed_call_;
};

class ConvBnModule : public TrainingModule {
 public:
  explicit ConvBnModule(bool typed_call = false) : typed_call_(typed_call) {}
  std::shared_ptr<torch::nn::Module> configure_model() override {
    net_ = std::make_shared<ConvBnImpl>(typed_call_);
    auto g = at::detail::createCPUGenerator(5);
    at::NoGradGuard no_grad;
    for (auto& p : net_->parameters()) p.copy_(at::randn(p.sizes(), g) * 0.5);
    return net_;
  }
  at::Tensor training_step(const Batch& b, int64_t) override {
    return at::cross_entropy_loss(forward([&] { return net_->forward(b.inputs); }), b.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    return {std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.5))};
  }
  std::shared_ptr<ConvBnImpl> net_;
  bool typed_call_;
};

// 32 images, the odd ones brighter: with the interleaved rank shares of
// DistributedSampler, rank 1 sees only bright ones.
std::shared_ptr<TensorDataset> Images() {
  auto g = at::detail::createCPUGenerator(3);
  at::Tensor x = at::randn({32, 1, 6, 6}, g) + (at::arange(32) % 2).to(at::kFloat).view({32, 1, 1, 1}) * 3;
  return std::make_shared<TensorDataset>(x, at::randint(0, 3, {32}, g));
}

struct Trained {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> state;  // rank 0's full state dict
};

Trained Train(int world, bool sync_batchnorm) {
  auto data = Images();
  TrainerOptions o;
  o.max_epochs = 1;
  o.batch_size = 8 / world;  // a global batch of 8: 4 steps
  o.shuffle = false;
  o.enable_checkpointing = false;
  o.enable_logger = false;
  o.enable_progress_bar = false;
  o.default_root_dir = ::testing::TempDir();
  o.strategy = world > 1 ? "ddp" : "single_device";
  o.sync_batchnorm = sync_batchnorm;
  Trained out;
  std::mutex mu;
  shardtrain::testing::RunRanks(world, [&](int rank, const auto& comm) {
    ConvBnModule module;
    Trainer trainer(o, comm);
    trainer.Fit(module, *data);
    auto state = trainer.strategy().FullStateDict();
    // The running statistics are buffers every rank keeps: rank 1's too.
    EXPECT_EQ(trainer.sync_batchnorm() != nullptr, sync_batchnorm);
    if (rank != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    out.losses = trainer.step_losses();
    out.state = state;
  });
  return out;
}

TEST(SyncBatchNorm, TrainerAtTwoRanksMatchesOneProcess) {
  const Trained one = Train(1, /*sync_batchnorm=*/false);
  const Trained synced = Train(2, /*sync_batchnorm=*/true);
  const Trained local = Train(2, /*sync_batchnorm=*/false);
  ASSERT_EQ(one.losses.size(), 4u);
  ASSERT_EQ(synced.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(synced.losses[i], one.losses[i], 1e-6) << "step " << i;
  for (const auto& [name, t] : one.state) {
    ASSERT_TRUE(synced.state.count(name)) << name;
    EXPECT_LT(MaxDiff(synced.state.at(name).to(at::kDouble), t.to(at::kDouble)), 1e-5) << name;
  }
  // Without sync_batchnorm each rank normalizes (and tracks) its own half.
  EXPECT_GT(MaxDiff(local.state.at("bn.running_mean"), one.state.at("bn.running_mean")), 1e-2);
  double loss_gap = 0;
  for (size_t i = 0; i < 4; ++i) loss_gap = std::max(loss_gap, std::abs(local.losses[i] - one.losses[i]));
  EXPECT_GT(loss_gap, 1e-3);
}

TEST(SyncBatchNorm, ModelCallingItsTypedMemberIsAClearError) {
  auto data = Images();
  TrainerOptions o;
  o.max_epochs = 1;
  o.batch_size = 4;
  o.enable_checkpointing = false;
  o.enable_logger = false;
  o.enable_progress_bar = false;
  o.default_root_dir = ::testing::TempDir();
  o.sync_batchnorm = true;
  try {
    shardtrain::testing::RunRanks(2, [&](int, const auto& comm) {
      ConvBnModule module(/*typed_call=*/true);
      Trainer trainer(o, comm);
      trainer.Fit(module, *data);
    });
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("BatchNorm 'bn'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ForwardBatchNorm"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardtrain::trainer
