// FSDP core: which units hold full parameters and gradients while they compute
// (ProbeNet), and the communication volume of every sharding strategy against theory.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <map>
#include <mutex>
#include <set>

#include "base/errors.h"
#include "sharding/flat_parameter.h"
#include "sharding/sharded_model.h"
#include "tests/sharding/probe_net.h"
#include "tests/testing/models.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::sharding {
namespace {

using shardtrain::testing::RunRanks;

int64_t ParameterStorageBytes(torch::nn::Module& m) {
  std::set<const void*> seen;
  int64_t total = 0;
  for (auto& p : m.parameters()) {
    const void* s = p.storage().unsafeGetStorageImpl();
    if (seen.insert(s).second) total += static_cast<int64_t>(p.storage().nbytes());
  }
  return total;
}

TEST(ShardedMemory, OnlyTheComputingUnitAndPrefetchedOnesHoldFullParameters) {
  for (bool forward_prefetch : {false, true}) {
    RunRanks(2, [&](int rank, const auto& comm) {
      auto net = std::make_shared<ProbeNetImpl>(4);
      ShardingOptions o;
      o.forward_prefetch = forward_prefetch;
      o.limit_all_gathers = 2;
      ShardedModel sm(net, comm, o);
      auto units = sm.units();  // 4 blocks then root
      const int64_t block_full = units[0].padded_numel * 4, root_full = units.back().padded_numel * 4;
      // Nothing is gathered between steps: only shards exist.
      EXPECT_EQ(ParameterStorageBytes(*net), 0);
      at::Tensor x = at::randn({4, 64});
      // One step first: prefetching follows the execution order the first step recorded.
      sm.Forward([&] { return net->forward(x); }).sum().backward();
      std::vector<int64_t> seen;
      g_probe = [&](int) {
        if (rank == 0) seen.push_back(ParameterStorageBytes(*net));
      };
      at::Tensor out = sm.Forward([&] { return net->forward(x); });
      g_probe = nullptr;
      out.sum().backward();
      if (rank == 0) {
        ASSERT_EQ(seen.size(), 4u);
        for (size_t k = 0; k < seen.size(); ++k) {
          // Block k plus the root; with forward prefetch block k+1 too (bounded by limit_all_gathers).
          const bool prefetched = forward_prefetch && k + 1 < seen.size();
          EXPECT_EQ(seen[k], root_full + block_full * (prefetched ? 2 : 1)) << "block " << k;
        }
      }
      // After backward everything is resharded again.
      EXPECT_EQ(ParameterStorageBytes(*net), 0);
    });
  }
}

// Reduce-scatters complete while backward runs: when the first block's
// backward starts, the later blocks' full-size gradients are gone except for
// the (at most two) reduce-scatters still in flight.
TEST(ShardedMemory, FullGradientsAreFreedDuringBackward) {
  RunRanks(2, [&](int rank, const auto& comm) {
    auto net = std::make_shared<ProbeNetImpl>(6);
    ShardedModel sm(net, comm, {});
    at::Tensor x = at::randn({4, 64});
    for (int step = 0; step < 2; ++step) {
      int at_first_block = -1;
      at::Tensor out = sm.Forward([&] {
        at::Tensor h = net->b[0]->forward(x);
        h.register_hook([&](const at::Tensor&) { at_first_block = sm.NumFullGradients(); });
        for (size_t i = 1; i < net->b.size(); ++i) h = net->b[i]->forward(h);
        return net->head->forward(h);
      });
      out.sum().backward();
      // The root's (reduced last) and block 0's (its backward may have armed
      // it) plus at most 2 in flight; without completing reduce-scatters
      // during backward, blocks 1..5 would all still hold theirs (7 in all).
      EXPECT_GE(at_first_block, 1) << "step " << step;
      EXPECT_LE(at_first_block, 4) << "step " << step;
      EXPECT_EQ(sm.NumFullGradients(), 0) << "step " << step;
    }
  });
}

TEST(ShardedCommVolume, MatchesTheoryPerStrategy) {
  for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    RunRanks(2, [&](int rank, const auto& comm) {
      auto net = std::make_shared<ProbeNetImpl>(3);
      ShardingOptions o;
      o.sharding_strategy = strategy;
      ShardedModel sm(net, comm, o);
      at::Tensor x = at::randn({4, 64});
      comm->ResetStats();
      sm.Forward([&] { return net->forward(x); }).sum().backward();
      const auto s = comm->stats();
      int64_t blocks = 0, all = 0;
      for (auto& u : sm.units()) {
        all += u.padded_numel * 4;
        if (!u.name.empty()) blocks += u.padded_numel * 4;
      }
      const int W = 2;
      switch (strategy) {
        case ShardingStrategy::kFullShard:  // blocks gathered in forward and backward, root once
          EXPECT_EQ(s.BytesSent(comm::CommOp::kAllGather), (2 * blocks + (all - blocks)) * (W - 1) / W);
          EXPECT_EQ(s.BytesSent(comm::CommOp::kReduceScatter), all * (W - 1) / W);
          EXPECT_EQ(s.BytesSent(comm::CommOp::kAllReduce), 0);
          break;
        case ShardingStrategy::kShardGradOp:
          EXPECT_EQ(s.BytesSent(comm::CommOp::kAllGather), all * (W - 1) / W);
          EXPECT_EQ(s.BytesSent(comm::CommOp::kReduceScatter), all * (W - 1) / W);
          break;
        case ShardingStrategy::kNoShard:
          EXPECT_EQ(s.BytesSent(comm::CommOp::kAllGather), 0);
          EXPECT_EQ(s.BytesSent(comm::CommOp::kReduceScatter), 0);
          EXPECT_EQ(s.BytesSent(comm::CommOp::kAllReduce), 2 * all * (W - 1) / W);
          break;
        default:
          break;
      }
    });
  }
}

}  // namespace
}  // namespace shardtrain::sharding
