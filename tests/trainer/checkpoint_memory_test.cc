// Full checkpoints do not materialise the full model: threads-as-ranks W=4
// (fsdp_native FULL_SHARD, Adam) through the Trainer, a model of 8 equal
// units, with LibTorch's CPU allocator counted per rank thread
// (tests/testing/counting_allocator.h). During the full save and during the
// full load, each rank's peak live bytes beyond its training state stay
// within one unit's parameters and Adam state (x 1.15) plus slack; holding
// the whole model (8 units) anywhere breaks that many times over.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>

#include "sharding/sharded_model.h"
#include "strategies/sharded_strategy_base.h"
#include "tests/testing/counting_allocator.h"
#include "tests/trainer/fixtures.h"
#include "tests/trainer/unit_stack.h"
#include "trainer/checkpoint.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;
namespace st = shardtrain::testing;

constexpr int kWorld = 4;
constexpr int kUnits = 8;
constexpr int64_t kDim = 384;
// One unit: Linear(kDim, kDim) as float32.
constexpr int64_t kUnitBytes = (kDim * kDim + kDim) * 4;
// One unit's parameters and its Adam state (exp_avg, exp_avg_sq).
constexpr int64_t kUnitStateBytes = 3 * kUnitBytes;
constexpr int64_t kSlack = 256 << 10;
const int64_t kBound = static_cast<int64_t>(1.15 * kUnitStateBytes) + kSlack;

// Records the live bytes when the optimizer is made (the last user code
// before a checkpoint is loaded) and the peak and live bytes at on_fit_start
// (right after it is loaded).
class StackModule : public TrainingModule {
 public:
  std::shared_ptr<torch::nn::Module> configure_model() override {
    net_ = std::make_shared<UnitStack>(kUnits, kDim, 3);
    auto g = at::detail::createCPUGenerator(7);
    at::NoGradGuard no_grad;
    for (auto& p : net_->parameters()) p.copy_(at::randn(p.sizes(), g) * 0.05);
    return net_;
  }
  at::Tensor training_step(const Batch& b, int64_t) override {
    at::Tensor x = at::cat({b.inputs, at::zeros({b.inputs.size(0), kDim - b.inputs.size(1)})}, 1);
    at::Tensor out = forward([&] { return net_->forward(x); });
    return at::cross_entropy_loss(out, b.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    OptimizerConfig c;
    c.optimizer = std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
    st::ResetPeakCpuBytesOfThisThread();
    return c;
  }
  void on_fit_start() override {
    peak_before_start = st::PeakCpuBytesOfThisThread();
    live_at_start = st::LiveCpuBytesOfThisThread();
  }
  int64_t peak_before_start = 0, live_at_start = 0;
  std::shared_ptr<UnitStack> net_;
};

TrainerOptions Options(const std::string& root) {
  TrainerOptions o = BaseOptions(root, kWorld);
  o.strategy = "fsdp_native";
  o.strategy_options = {{"sharding_strategy", "FULL_SHARD"}};
  o.enable_checkpointing = false;
  o.max_epochs = -1;
  o.max_steps = 2;
  return o;
}

TEST(FullCheckpointMemory, SaveAndLoadHoldAboutOneUnitPerRank) {
  st::InstallCountingCpuAllocator();
  const std::string dir = TmpDir("full_memory");
  const std::string path = dir + "/full.ckpt";
  auto train = MakeData(64, 1);
  std::array<int64_t, kWorld> save_extra{}, load_extra{};
  std::array<int, kWorld> units{};
  shardtrain::testing::RunRanks(kWorld, [&](int rank, const auto& comm) {
    StackModule module;
    Trainer trainer(Options(dir + "/fit"), comm);
    trainer.Fit(module, *train, nullptr);
    units[rank] = dynamic_cast<strategies::ShardedStrategyBase&>(trainer.strategy()).sharded_model().num_units();
    const int64_t base = st::LiveCpuBytesOfThisThread();  // shards, gradients, Adam state
    st::ResetPeakCpuBytesOfThisThread();
    trainer.SaveCheckpoint(path, CheckpointFormat::kFull);
    save_extra[rank] = st::PeakCpuBytesOfThisThread() - base;
  });
  shardtrain::testing::RunRanks(kWorld, [&](int rank, const auto& comm) {
    StackModule module;
    Trainer trainer(Options(dir + "/resume"), comm);
    trainer.Fit(module, *train, nullptr, path);  // loads, then stops: max_steps is reached
    load_extra[rank] = module.peak_before_start - module.live_at_start;
    EXPECT_EQ(trainer.global_step(), 2);
  });
  std::printf("unit: %lld bytes of parameters, %lld with Adam state; bound %lld bytes\n",
              static_cast<long long>(kUnitBytes), static_cast<long long>(kUnitStateBytes),
              static_cast<long long>(kBound));
  for (int r = 0; r < kWorld; ++r) {
    std::printf("rank %d: full save peak %lld bytes beyond training state (%.2f units), full load %lld (%.2f)\n", r,
                static_cast<long long>(save_extra[r]), double(save_extra[r]) / kUnitBytes,
                static_cast<long long>(load_extra[r]), double(load_extra[r]) / kUnitBytes);
  }
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(units[r], kUnits + 1) << "8 blocks and the root";
    EXPECT_LE(save_extra[r], kBound) << "rank " << r << " held more than one unit during the full save";
    EXPECT_LE(load_extra[r], kBound) << "rank " << r << " held more than one unit during the full load";
  }
  // The file is complete: every parameter and its Adam state, at full size.
  CheckpointData ck = LoadCheckpoint(path);
  EXPECT_EQ(ck.state_dict.at("b3.fc.weight").sizes(), (std::vector<int64_t>{kDim, kDim}));
  EXPECT_EQ(ck.optimizer_full.kind, "Adam");
  EXPECT_EQ(ck.optimizer_full.state.at("b7.fc.bias").at("exp_avg_sq").numel(), kDim);
  EXPECT_TRUE(ck.optimizer_states.empty()) << "Adam state is stored once, by name";
}

}  // namespace
}  // namespace shardtrain::trainer
