// Sharded construction through the Trainer (moved from
// //tests/sharding:sharded_init_test, which then needs no trainer: CI's
// ASan+UBSan step builds the sharding tests and their dependencies, and the
// trainer was ~65 of its ~150 compiles). The models are
// tests/sharding/sharded_init_net.h's.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/errors.h"
#include "sharding/flat_parameter.h"
#include "strategies/registry.h"
#include "strategies/sharded_strategy_base.h"
#include "tests/sharding/sharded_init_net.h"
#include "tests/testing/multi_rank.h"
#include "trainer/data/data.h"
#include "trainer/trainer.h"
#include "trainer/training_module.h"

namespace shardtrain::sharding {
namespace {

using shardtrain::testing::RunRanks;
using namespace shardtrain::sharding::init_net;  // NOLINT: the test models

// Through the Trainer: the strategy's scope is held around configure_model.
class NetModule : public trainer::TrainingModule {
 public:
  std::shared_ptr<torch::nn::Module> configure_model() override {
    // Every rank thread has passed the Trainer's at::manual_seed, which would
    // otherwise reseed the shared generator while another rank constructs.
    comm->Barrier()->Wait();
    net_ = BuildLocked<NetImpl>(8, nullptr);  // inside the Trainer's scope, if any
    built_sharded = StorageIsFreed(net_->b0->inner->a->weight);
    return net_;
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    return (forward([&] { return net_->forward(b.inputs); }) - b.targets).pow(2).mean();
  }
  trainer::OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    return {std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2))};
  }
  std::shared_ptr<NetImpl> net_;
  bool built_sharded = false;
  comm::CommunicatorPtr comm;
};

TEST(ShardedInit, TrainerHoldsTheScopeAroundConfigureModel) {
  auto g = at::detail::createCPUGenerator(31);
  trainer::TensorDataset data(at::randn({16, 8}, g), at::randn({16}, g));
  // Off; on through the strategy's setter, through TrainerOptions, and through
  // the strategy's string option.
  std::map<std::string, at::Tensor> final_state[4];
  std::vector<double> losses[4];
  for (int on : {0, 1, 2, 3}) {
    RunRanks(2, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
      trainer::TrainerOptions o;
      o.default_root_dir = ::testing::TempDir() + "/sharded_init_trainer";
      o.max_steps = 3;
      o.batch_size = 4;
      o.shuffle = false;
      o.enable_checkpointing = false;
      o.enable_logger = false;
      o.enable_progress_bar = false;
      if (on <= 1) {
        auto s = strategies::StrategyRegistry::Create("fsdp_native");
        dynamic_cast<strategies::ShardedStrategyBase&>(*s).set_sharded_construction(on == 1);
        o.strategy_object = s;
      } else {
        o.strategy = "fsdp_native";
        if (on == 2) o.sharded_construction = true;
        if (on == 3) o.strategy_options = {{"sharded_construction", "true"}};
      }
      NetModule module;
      module.comm = comm;
      trainer::Trainer t(o, comm);
      t.Fit(module, data);
      EXPECT_EQ(module.built_sharded, on != 0) << on;
      auto sd = t.strategy().FullStateDict();
      if (rank == 0) {
        final_state[on] = sd;
        losses[on] = t.step_losses();
      }
    });
  }
  EXPECT_EQ(losses[0].size(), 3u);
  for (int on : {1, 2, 3}) {
    EXPECT_EQ(losses[on], losses[0]) << on;
    ExpectBitEqual(final_state[on], final_state[0]);
  }
  // A strategy that holds the whole model refuses it, naming what is valid.
  trainer::TrainerOptions o;
  o.strategy = "ddp";
  o.sharded_construction = true;
  std::string msg = "<no error>";
  try {
    trainer::Trainer t(o);
  } catch (const InvalidArgumentError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("strategy 'ddp' holds the whole model on every rank: sharded_construction=true needs a sharded "
                     "strategy (fsdp, fsdp_native)"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace shardtrain::sharding
