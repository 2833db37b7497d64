// The CUDA-side checks of issue 29's fixes, for a GPU machine (built here
// with --config=cuda; bench/gpu/device_run.sh runs it from the bundle). Each
// test skips, saying why, where no CUDA device is visible.
//
// - force_collectives at W=1 on CUDA: every unit's gather goes through NCCL
//   and the stream ordering around it, with the results of the in-place path.
// - activation checkpointing with dropout on CUDA: the recomputed forward
//   draws the same masks (the CUDA generator's state is saved and restored),
//   so the gradients equal those of the run without checkpointing.
// - clip-by-norm with gradients on the GPU (the routine every strategy and the
//   core use; with a group, as use_orig_params): no wait for the device, the
//   norm and the scaled gradients of the CPU.
// - the forward overlap's ordering: the next unit's gather completes while
//   the current unit's forward still runs (forced path, W=1).
// - sharded construction for a GPU: only the shards move to it.
// - offload_params on a GPU: gradients copied to the host during backward.
// - the fit loop's loss sum: no wait for the device per micro-batch (CUDA's
//   sync debug mode set to "error"); the loader's pinned batches.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "comm/nccl_communicator.h"
#include "sharding/flat_parameter.h"
#include "sharding/grad_clip.h"
#include "sharding/sharded_init.h"
#include "sharding/sharded_model.h"
#include "sharding/wrap_point.h"
#include "tests/testing/models.h"
#include "tests/cuda/overlap_probe.h"
#include "tests/testing/recording_communicator.h"
#include "trainer/data/data_loader.h"
#include "trainer/loops/internal/loss_sum.h"

namespace shardtrain::sharding {
namespace {

#define REQUIRE_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device visible"

const c10::Device kCuda(c10::kCUDA, 0);

std::shared_ptr<comm::NcclCommunicator> WorldOfOne() {
  return comm::NcclCommunicator::Create(c10::make_intrusive<c10d::HashStore>(), 0, 1, {});
}

// Trains TinyGpt on the GPU for a few Adam steps; the final parameters and
// the world's all-gather count over the steps.
std::pair<std::map<std::string, at::Tensor>, int64_t> TrainTinyGpt(bool force_collectives, bool offload = false) {
  testing::TestModel tm = testing::TinyGpt();
  auto model = tm.make();
  model->to(kCuda);
  auto world = WorldOfOne();
  ShardingOptions o;
  o.force_collectives = force_collectives;
  o.offload_params = offload;
  ShardedModel sm(model, world, o, WrapPolicy::Always());
  // eps 1e-2: a gradient that is zero up to rounding (the key bias's: the
  // softmax ignores it) moves no weight by ~lr, whatever its rounding noise.
  torch::optim::Adam opt(sm.parameters(), torch::optim::AdamOptions(1e-2).eps(1e-2));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = tm.data(step, 8);
    opt.zero_grad();
    at::Tensor out = sm.Forward([&] { return tm.forward(sm.module(), x.to(kCuda)); });
    tm.loss(out, y.to(kCuda)).backward();
    opt.step();
  }
  const int64_t gathers = world->stats().Calls(comm::CommOp::kAllGather);  // the steps' (the state dict gathers too)
  std::map<std::string, at::Tensor> params;
  for (const auto& [k, v] : sm.FullStateDict(/*rank0_only=*/true)) params[k] = v.cpu();
  return {params, gathers};
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

// offload_params on a GPU (forced collectives, so each unit's gradient is
// reduce-scattered and copied to the host during backward on a side stream,
// sharding/internal/device_streams.h): the optimizer steps on host shards and
// the weights follow the in-place path's.
TEST(CudaFixes, OffloadedGradientsReachTheHostShards) {
  REQUIRE_GPU();
  auto [in_place, unused] = TrainTinyGpt(false);
  auto [offloaded, gathers] = TrainTinyGpt(true, /*offload=*/true);
  EXPECT_GT(gathers, 0);
  ASSERT_EQ(in_place.size(), offloaded.size());
  for (const auto& [name, p] : in_place) {
    // Adam on the CPU against Adam on the GPU: the same update up to rounding.
    EXPECT_TRUE(at::allclose(offloaded.at(name), p, 1e-4, 1e-5)) << name;
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

// The forward overlap's ordering, on the forced-collective path at W=1 (one
// GPU cannot run two NCCL ranks) and without forward_prefetch: b0's forward
// keeps the compute stream busy (a ~5 s spin kernel, then an event); b1's
// gather, issued by the host after b0's forward was queued, must complete
// while that kernel still runs, i.e. it waited only for the iteration's start
// and its own input, not for b0's compute (sharding/internal/device_streams.h).
// Issued from the compute stream (the ordering before the fix) it could not
// complete before the kernel ends. The results stay those of the in-place path
// (ForcedCollectivesAtW1MatchTheInPlacePath).
TEST(CudaFixes, NextUnitsGatherOverlapsTheCurrentUnitsForward) {
  REQUIRE_GPU();
  auto net = std::make_shared<ProbeNetImpl>();
  net->to(kCuda);
  auto recording = std::make_shared<testing::RecordingCommunicator>(WorldOfOne());
  ShardingOptions o;
  o.force_collectives = true;
  o.forward_prefetch = false;
  ShardedModel sm(net, recording, o, WrapPolicy::Always());
  const at::Tensor x = at::randn({32, 64}, at::TensorOptions().device(kCuda));
  sm.Forward([&] { return net->forward(x); }).sum().backward();  // order recorded, NCCL and pools warm
  torch::cuda::synchronize();

  OverlapProbe probe(*net, recording, kCuda, 10'000'000'000LL /* ~5 s at 2 GHz */, std::chrono::seconds(3));
  {
    at::NoGradGuard no_grad;
    sm.Forward([&] { return net->forward(x); });
  }
  torch::cuda::synchronize();
  EXPECT_TRUE(probe.overlapped()) << probe.Describe() << ": the gather waited for the previous unit's compute";
}

// Sharded construction for a GPU (the Trainer's path): the model is built on
// the CPU under a ShardedInitScope, MoveToDevice moves only the shards (the
// wrapped parameters stay valueless, now on the GPU), and the ShardedModel
// adopts them there with the values of a model built whole.
TEST(CudaFixes, ShardedConstructionMovesShardsToTheGpu) {
  REQUIRE_GPU();
  std::shared_ptr<ProbeNetImpl> built;
  {
    at::manual_seed(21);
    ShardedInitScope scope(ShardGroupPlace{0, 1});
    built = std::make_shared<ProbeNetImpl>();
  }
  ShardedInitScope::MoveToDevice(*built, kCuda);
  EXPECT_TRUE(built->b1->fc->weight.is_cuda());
  EXPECT_TRUE(StorageIsFreed(built->b1->fc->weight)) << "the whole unit reached the GPU";
  ShardingOptions o;
  o.force_collectives = true;
  ShardedModel sm(built, WorldOfOne(), o, WrapPolicy::Always());
  at::manual_seed(21);
  auto plain = std::make_shared<ProbeNetImpl>();
  const auto sd = sm.FullStateDict(/*rank0_only=*/true);
  for (const auto& item : plain->named_parameters()) {
    ASSERT_TRUE(sd.count(item.key())) << item.key();
    EXPECT_TRUE(at::equal(sd.at(item.key()).cpu(), item.value())) << item.key();
  }
}

// Clipping by norm on the GPU (sharding::ClipGradNorm, what every strategy's
// ClipGradNorm and the core's use, with a 1-rank NCCL group as
// use_orig_params passes): nothing waits for the device (CUDA's sync debug
// mode at "error"), and the norm and the scaled gradients equal the CPU's.
TEST(CudaFixes, ClipGradNormOnTheGpuWaitsForNothing) {
  REQUIRE_GPU();
  at::manual_seed(9);
  std::vector<at::Tensor> cpu = {at::randn({300}), at::randn({17, 5}), at::Tensor()};
  std::vector<at::Tensor> gpu;
  for (const auto& g : cpu) gpu.push_back(g.defined() ? g.to(kCuda) : g);
  const double cpu_norm = ClipGradNorm(cpu, 1.0, 2.0).item<double>();
  ASSERT_GT(cpu_norm, 1.0);  // so the gradients are scaled
  auto group = WorldOfOne();
  at::Tensor gpu_norm;
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    gpu_norm = ClipGradNorm(gpu, 1.0, 2.0, group);
  } catch (...) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    ADD_FAILURE() << "ClipGradNorm waited for the device";
    throw;
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_TRUE(gpu_norm.is_cuda());
  EXPECT_NEAR(gpu_norm.item<double>(), cpu_norm, 1e-9 * cpu_norm);
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(at::allclose(gpu[i].cpu(), cpu[i], 1e-6, 1e-7)) << i;
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
