// Activation checkpointing: which units recompute (exactly once per step),
// that recomputing saves memory for backward, that gradients equal the
// non-checkpointed run bit for bit (also with dropout and with a unit of
// several tensor inputs and outputs), and selection by module type through
// the strategies' options.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <iostream>
#include <map>
#include <mutex>
#include <set>

#include "base/errors.h"
#include "sharding/sharded_model.h"
#include "strategies/registry.h"
#include "tests/sharding/option_test_models.h"
#include "tests/testing/counting_allocator.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::sharding {
namespace {

using testmodels::CkptNetImpl;
using testmodels::g_hooks;
using shardtrain::testing::RunRanks;

constexpr int kIoId = 100;  // CkptNet's multi-input/output unit

struct CkptResult {
  std::vector<std::map<int, int>> calls;               // per rank: forward calls per block id
  std::vector<std::vector<at::Tensor>> grads;          // per rank, per step: every shard's gradient, concatenated
  std::vector<std::vector<at::Tensor>> masks;          // rank 0, per call in order: dropout masks of block 0
  std::vector<int64_t> saved_bytes;                    // per rank: live bytes at backward start minus before forward
};

struct CkptConfig {
  int world = 2;
  std::set<int> checkpointed;  // block ids (kIoId for the multi-tensor unit)
  int blocks = 4;
  int64_t width = 16;
  int64_t batch = 8;  // global
  double dropout = 0;
  int steps = 2;
};

CkptResult RunCkpt(const CkptConfig& c) {
  CkptResult r;
  r.calls.resize(c.world);
  r.grads.resize(c.world);
  r.saved_bytes.resize(c.world);
  r.masks.resize(c.blocks);
  shardtrain::testing::InstallCountingCpuAllocator();
  RunRanks(c.world, [&](int rank, const auto& comm) {
    auto net = std::make_shared<CkptNetImpl>(c.blocks, c.width, c.dropout);
    net->train();
    auto which = [&](const WrapPoint& wp) {
      if (&wp == static_cast<const WrapPoint*>(net->io.get())) return c.checkpointed.count(kIoId) > 0;
      for (auto& b : net->b) {
        if (&wp == static_cast<const WrapPoint*>(b.get())) return c.checkpointed.count(b->id_) > 0;
      }
      return false;
    };
    ShardedModel sm(net, comm, {}, WrapPolicy::Always(), which);
    torch::optim::SGD opt(sm.parameters(), torch::optim::SGDOptions(0.05));
    g_hooks.on_forward = [&](int id) { ++r.calls[rank][id]; };
    g_hooks.on_dropout = [&](int id, const at::Tensor& mask) {
      if (rank == 0) r.masks[id].push_back(mask.clone());
    };
    const int64_t per = c.batch / c.world;
    for (int step = 0; step < c.steps; ++step) {
      auto gen = at::detail::createCPUGenerator(40 + step);
      at::Tensor x = at::randn({c.batch, c.width}, gen).slice(0, rank * per, (rank + 1) * per);
      if (c.dropout > 0) at::manual_seed(70 + step);  // the same masks in both runs (W=1: one RNG user)
      const int64_t before = shardtrain::testing::LiveCpuBytesOfThisThread();
      at::Tensor loss = sm.Forward([&] { return net->forward(x); }).pow(2).mean();
      loss.register_hook([&](const at::Tensor&) {
        r.saved_bytes[rank] = shardtrain::testing::LiveCpuBytesOfThisThread() - before;
      });
      loss.backward();
      std::vector<at::Tensor> gs;
      for (auto& p : sm.parameters()) gs.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
      r.grads[rank].push_back(at::cat(gs));
      opt.step();
      opt.zero_grad();
    }
    g_hooks = {};
  });
  return r;
}

void ExpectBitEqualGradients(const CkptResult& a, const CkptResult& b) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t rank = 0; rank < a.grads.size(); ++rank) {
    ASSERT_EQ(a.grads[rank].size(), b.grads[rank].size());
    for (size_t s = 0; s < a.grads[rank].size(); ++s) {
      EXPECT_TRUE(at::equal(a.grads[rank][s], b.grads[rank][s]))
          << "rank " << rank << " step " << s << ": max diff "
          << (a.grads[rank][s] - b.grads[rank][s]).abs().max().item<double>();
    }
  }
}

TEST(ActivationCheckpointing, RecomputesEachCheckpointedUnitOncePerStep) {
  CkptConfig c;
  c.checkpointed = {0, 2, kIoId};  // kIoId: tensor + non-grad tensor + double in, a tuple of two tensors out
  auto ckpt = RunCkpt(c);
  c.checkpointed = {};
  auto plain = RunCkpt(c);
  for (int rank = 0; rank < c.world; ++rank) {
    for (int id : {0, 1, 2, 3, kIoId}) {
      const bool recomputed = id == 0 || id == 2 || id == kIoId;
      EXPECT_EQ(ckpt.calls[rank][id], c.steps * (recomputed ? 2 : 1)) << "rank " << rank << " block " << id;
      EXPECT_EQ(plain.calls[rank][id], c.steps) << "rank " << rank << " block " << id;
    }
  }
  ExpectBitEqualGradients(ckpt, plain);
}

TEST(ActivationCheckpointing, SavesFewerBytesForBackwardWithBitEqualGradients) {
  CkptConfig c;
  // One rank: no collective is in flight during the measured window (at W=2
  // over TCP, Gloo releases the previous collectives' buffers at times of its
  // own, which moved the per-thread count by up to 0.5 MB in 14 of 50 runs).
  c.world = 1;
  c.width = 64;
  c.batch = 64;
  c.checkpointed = {0, 1, 2, 3, kIoId};
  auto ckpt = RunCkpt(c);
  c.checkpointed = {};
  auto plain = RunCkpt(c);
  for (int rank = 0; rank < c.world; ++rank) {
    std::cout << "rank " << rank << ": bytes kept for backward " << plain.saved_bytes[rank] << " without, "
              << ckpt.saved_bytes[rank] << " with activation checkpointing\n";
    // Per block without checkpointing: fc1's output, gelu's output (4x wide)
    // and the tanh output; with it: the block's input only.
    const int64_t wide = (c.batch / c.world) * 4 * c.width * 4;
    EXPECT_GT(plain.saved_bytes[rank], 0);
    EXPECT_LE(ckpt.saved_bytes[rank], plain.saved_bytes[rank] - c.blocks * 2 * wide) << "rank " << rank;
  }
  ExpectBitEqualGradients(ckpt, plain);
}

// One rank: the default CPU generator is per process, so rank threads would
// draw from it concurrently (separate processes each have their own).
TEST(ActivationCheckpointing, DropoutMaskOfTheRecomputeEqualsTheForwards) {
  CkptConfig c;
  c.world = 1;
  c.dropout = 0.3;
  c.checkpointed = {0, 1, 2, 3};
  auto ckpt = RunCkpt(c);
  c.checkpointed = {};
  auto plain = RunCkpt(c);
  for (int id = 0; id < c.blocks; ++id) {
    ASSERT_EQ(ckpt.masks[id].size(), 2u * c.steps) << "block " << id;
    ASSERT_EQ(plain.masks[id].size(), 1u * c.steps) << "block " << id;
    for (int s = 0; s < c.steps; ++s) {
      const at::Tensor& forward = ckpt.masks[id][2 * s];
      const at::Tensor& recompute = ckpt.masks[id][2 * s + 1];
      EXPECT_GT(forward.sum().item<int64_t>(), 0) << "dropout dropped nothing";
      EXPECT_TRUE(at::equal(forward, recompute)) << "block " << id << " step " << s;
      EXPECT_TRUE(at::equal(forward, plain.masks[id][s])) << "block " << id << " step " << s;
    }
  }
  ExpectBitEqualGradients(ckpt, plain);
}

TEST(ActivationCheckpointing, VectorOutputsRecomputeAndStructOutputsAreAClearError) {
  auto run = [](bool checkpoint) {
    std::vector<at::Tensor> grads;
    int calls = 0;
    RunRanks(2, [&](int rank, const auto& comm) {
      auto net = std::make_shared<testmodels::VecNetImpl>();
      ShardedModel sm(net, comm, {}, WrapPolicy::Always(), [&](const WrapPoint& wp) {
        return checkpoint && &wp == static_cast<const WrapPoint*>(net->v.get());
      });
      int mine = 0;
      g_hooks.on_forward = [&](int) { ++mine; };
      at::Tensor x = at::linspace(-1, 1, 8).reshape({2, 4});
      sm.Forward([&] { return net->forward(x); }).backward();
      g_hooks = {};
      if (rank == 0) {
        calls = mine;
        for (auto& p : sm.parameters()) grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
      }
    });
    return std::make_pair(calls, at::cat(grads));
  };
  auto [ckpt_calls, ckpt_grads] = run(true);
  auto [plain_calls, plain_grads] = run(false);
  EXPECT_EQ(ckpt_calls, 2);
  EXPECT_EQ(plain_calls, 1);
  EXPECT_TRUE(at::equal(ckpt_grads, plain_grads));

  RunRanks(1, [&](int, const auto& comm) {
    auto net = std::make_shared<testmodels::VecNetImpl>();
    ShardedModel sm(net, comm, {}, WrapPolicy::Always(), [](const WrapPoint&) { return true; });
    try {
      sm.Forward([&] { return net->forward_labeled(at::ones({2, 4})); });
      ADD_FAILURE() << "expected an error";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("activation checkpointing of unit 'l' (shardtrain::testmodels::LabeledImpl) "
                                           "is not possible: forward must return at::Tensor, std::tuple<at::Tensor, "
                                           "...> or std::vector<at::Tensor>"),
                std::string::npos)
          << e.what();
    }
  });
}

// --- through the strategies ----------------------------------------------------

// Trains one step through the strategy and returns rank 0's forward calls per block id.
std::map<int, int> CallsThroughStrategy(const std::string& name, const strategies::StrategyOptions& opts) {
  std::map<int, int> calls;
  RunRanks(2, [&](int rank, const auto& comm) {
    auto net = std::make_shared<CkptNetImpl>(2, 8);
    auto s = strategies::StrategyRegistry::Create(name, opts);
    s->Setup(comm, {});
    s->WrapModel(net);
    s->module().train();
    std::map<int, int> mine;
    g_hooks.on_forward = [&](int id) { ++mine[id]; };
    at::Tensor x = at::randn({2, 8});
    s->Backward(s->Forward([&] { return net->forward(x); }).pow(2).mean());
    g_hooks = {};
    if (rank == 0) calls = mine;
  });
  return calls;
}

TEST(ActivationCheckpointingOptions, StrategiesCheckpointTheNamedModuleTypes) {
  struct Case {
    std::string strategy;
    strategies::StrategyOptions options;
    std::set<int> recomputed;
  };
  const std::vector<Case> cases = {
      {"fsdp_native", {}, {}},
      {"fsdp_native", {{"activation_checkpointing_policy", "type:CkptBlockImpl"}}, {0, 1}},
      {"fsdp_native", {{"activation_checkpointing_policy", "type:testmodels::MultiIoBlockImpl"}}, {kIoId}},
      {"fsdp_native", {{"activation_checkpointing", "MultiIoBlockImpl"}}, {kIoId}},
      {"fsdp_native", {{"activation_checkpointing", "shardtrain::testmodels::CkptBlockImpl, MultiIoBlockImpl"}},
       {0, 1, kIoId}},
      // A name matches whole "::"-separated parts only.
      {"fsdp_native", {{"activation_checkpointing", "BlockImpl,models::CkptBlockImpl"}}, {}},
      {"fsdp", {{"activation_checkpointing", "testmodels::CkptBlockImpl"}, {"min_num_params", "1"}}, {0, 1}},
  };
  for (const auto& c : cases) {
    std::string label = c.strategy;
    for (auto& [k, v] : c.options) label += " " + k + "=" + v;
    auto calls = CallsThroughStrategy(c.strategy, c.options);
    for (int id : {0, 1, kIoId}) EXPECT_EQ(calls[id], c.recomputed.count(id) ? 2 : 1) << label << ", block " << id;
  }
}

TEST(ActivationCheckpointingOptions, BothSpellingsAtOnceIsAnError) {
  try {
    strategies::StrategyRegistry::Create(
        "fsdp_native", {{"activation_checkpointing", "A"}, {"activation_checkpointing_policy", "type:B"}});
    ADD_FAILURE() << "expected an error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("not both"), std::string::npos) << e.what();
  }
  try {
    strategies::StrategyRegistry::Create("fsdp", {{"activation_checkpointing", " , "}});
    ADD_FAILURE() << "expected an error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("at least one module type name"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardtrain::sharding
