// The CUDA checks that need two GPUs (issue 29), written now so that a
// machine with two or more runs them as they are; each skips, saying why,
// where fewer are visible. Ranks are threads, rank r on cuda:r, over NCCL
// with an in-process store.
//
// - FULL_SHARD at W=2 over NCCL trains TinyGpt like one GPU with the whole
//   batch (Adam, 3 steps).
// - The next unit's gather overlaps the current unit's forward across ranks
//   (the forced-path proof of cuda_fixes_test, here on the real W=2 path).
// - The stall watch on NCCL: a rank that stops issuing collectives is named,
//   and its peer's collective fails after stall_timeout, long before timeout.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "base/errors.h"
#include "comm/nccl_communicator.h"
#include "sharding/sharded_model.h"
#include "sharding/wrap_point.h"
#include "tests/testing/models.h"
#include "tests/cuda/overlap_probe.h"
#include "tests/testing/recording_communicator.h"

namespace shardtrain::sharding {
namespace {

#define REQUIRE_TWO_GPUS()                                             \
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) \
  GTEST_SKIP() << "skipped: needs 2 CUDA devices, " << torch::cuda::device_count() << " visible"

// Runs fn(rank, communicator) on two threads, rank r on cuda:r.
void RunTwoRanks(const comm::NcclOptions& base,
                 const std::function<void(int, std::shared_ptr<comm::NcclCommunicator>)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        c10::cuda::set_device(static_cast<c10::DeviceIndex>(r));
        comm::NcclOptions o = base;
        o.device = r;
        fn(r, comm::NcclCommunicator::Create(store, r, 2, o));
      } catch (const std::exception& e) {  // a throw would end the process from a thread
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
}

std::map<std::string, at::Tensor> Train(testing::TestModel& tm, int rank, int world,
                                        const comm::CommunicatorPtr& comm) {
  const c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
  auto model = tm.make();
  model->to(dev);
  ShardedModel sm(model, comm, {}, WrapPolicy::Always());
  torch::optim::Adam opt(sm.parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = tm.data(step, 8);
    const int64_t n = 8 / world;
    x = x.narrow(0, rank * n, n).to(dev);
    y = y.narrow(0, rank * n, n).to(dev);
    opt.zero_grad();
    at::Tensor out = sm.Forward([&] { return tm.forward(sm.module(), x); });
    tm.loss(out, y).backward();
    opt.step();
  }
  std::map<std::string, at::Tensor> params;
  for (const auto& [k, v] : sm.FullStateDict(/*rank0_only=*/true)) params[k] = v.cpu();
  return params;
}

TEST(MultiGpu, FullShardAtW2TrainsLikeOneGpu) {
  REQUIRE_TWO_GPUS();
  testing::TestModel tm = testing::TinyGpt();
  auto one = comm::NcclCommunicator::Create(c10::make_intrusive<c10d::HashStore>(), 0, 1, {});
  const auto want = Train(tm, 0, 1, one);
  std::map<std::string, at::Tensor> got;
  RunTwoRanks({}, [&](int rank, std::shared_ptr<comm::NcclCommunicator> comm) {
    auto params = Train(tm, rank, 2, comm);
    if (rank == 0) got = std::move(params);
  });
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, p] : want) EXPECT_TRUE(at::allclose(got.at(name), p, 1e-4, 1e-5)) << name;
}

// Both ranks keep their compute stream busy in b0's forward (a ~3 s spin,
// then an event); b1's gather, issued by the host after that, must complete
// on each rank while the spin still runs: it waited only for the
// iteration's start and its input, not for b0's compute (without
// forward_prefetch; sharding/internal/device_streams.h).
TEST(MultiGpu, NextUnitsGatherOverlapsTheForwardAcrossRanks) {
  REQUIRE_TWO_GPUS();
  RunTwoRanks({}, [&](int rank, std::shared_ptr<comm::NcclCommunicator> nccl) {
    const c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
    at::manual_seed(3);
    auto net = std::make_shared<ProbeNetImpl>();
    net->to(dev);
    auto recording = std::make_shared<testing::RecordingCommunicator>(nccl);
    ShardingOptions o;
    o.forward_prefetch = false;
    ShardedModel sm(net, recording, o, WrapPolicy::Always());
    const at::Tensor x = at::randn({16, 64}, at::TensorOptions().device(dev));
    sm.Forward([&] { return net->forward(x); }).sum().backward();
    torch::cuda::synchronize(rank);
    OverlapProbe probe(*net, recording, dev, 6'000'000'000LL /* ~3 s */, std::chrono::seconds(2));
    {
      at::NoGradGuard no_grad;
      sm.Forward([&] { return net->forward(x); });
    }
    torch::cuda::synchronize(rank);
    EXPECT_TRUE(probe.overlapped()) << "rank " << rank << ": " << probe.Describe();
  });
}

// Rank 1 stops issuing collectives for 12 s; rank 0's all-reduce fails after
// the stall timeout (3 s) with CommTimeoutError naming rank 1, long before the
// 60 s timeout.
TEST(MultiGpu, StallWatchNamesTheStalledRankOnNccl) {
  REQUIRE_TWO_GPUS();
  comm::NcclOptions o;
  o.timeout = std::chrono::seconds(60);
  o.stall_timeout = std::chrono::seconds(3);
  o.heartbeat_period = std::chrono::milliseconds(200);
  o.blocking_wait = true;  // Wait blocks the host and throws
  RunTwoRanks(o, [&](int rank, std::shared_ptr<comm::NcclCommunicator> comm) {
    const c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
    at::Tensor t = at::ones({4}, at::TensorOptions().device(dev));
    comm->AllReduce(t, {})->Wait();  // both alive first
    torch::cuda::synchronize(rank);
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(12));
      try {
        comm->AllReduce(t, {})->Wait();
        torch::cuda::synchronize(rank);
      } catch (const std::exception&) {
        // the peer aborted: expected either way
      }
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    std::string error = "<none>";
    try {
      comm->AllReduce(t, {})->Wait(std::chrono::seconds(30));
      torch::cuda::synchronize(rank);
    } catch (const CommTimeoutError& e) {
      error = e.what();
    }
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_NE(error.find("rank 1"), std::string::npos) << error;
    EXPECT_LT(took, std::chrono::seconds(10)) << error;
  });
}

}  // namespace
}  // namespace shardtrain::sharding
