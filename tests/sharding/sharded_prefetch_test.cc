// Backward prefetch and limit_all_gathers, observed: the order of the
// collectives a rank issues in backward (through a recording communicator,
// with marks from the blocks' own backward) and the number of units holding
// full parameters while blocks compute.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>

#include "sharding/sharded_model.h"
#include "tests/sharding/option_test_models.h"
#include "tests/testing/multi_rank.h"
#include "tests/testing/recording_communicator.h"

namespace shardtrain::sharding {
namespace {

using shardtrain::testing::CommEvent;
using shardtrain::testing::RecordingCommunicator;
using shardtrain::testing::RunRanks;
using testmodels::ChainNetImpl;
using testmodels::g_hooks;
using testmodels::NestedChainNetImpl;

struct BackwardLog {
  std::vector<CommEvent> events;  // rank 0, second step's backward
  std::vector<UnitInfo> units;    // b0..b3, root
};

// Blocks of distinct sizes, so every collective names its unit by its size.
BackwardLog RecordBackward(BackwardPrefetch prefetch) {
  BackwardLog log;
  RunRanks(2, [&](int rank, const auto& gloo) {
    auto rec = std::make_shared<RecordingCommunicator>(gloo);
    auto net = std::make_shared<ChainNetImpl>(std::vector<int64_t>{6, 8, 10, 12, 14});
    ShardingOptions o;
    o.backward_prefetch = prefetch;
    ShardedModel sm(net, rec, o);
    at::Tensor x = at::ones({4, 6});
    // The first step records the execution order that prefetching follows.
    sm.Forward([&] { return net->forward(x); }).pow(2).mean().backward();
    g_hooks.on_grads = [&](int id) { rec->Mark("grads b" + std::to_string(id)); };
    g_hooks.on_pre_backward = [&](int id) { rec->Mark("pre-backward b" + std::to_string(id)); };
    at::Tensor loss = sm.Forward([&] { return net->forward(x); }).pow(2).mean();
    rec->ClearEvents();
    loss.backward();
    g_hooks = {};
    if (rank == 0) {
      log.events = rec->events();
      log.units = sm.units();
    }
  });
  return log;
}

// Index of the first event that `pred` accepts, or -1.
template <typename Pred>
int Find(const std::vector<CommEvent>& events, Pred pred) {
  auto it = std::find_if(events.begin(), events.end(), pred);
  return it == events.end() ? -1 : static_cast<int>(it - events.begin());
}

struct Positions {
  int pre_backward;  // mark: backward reached the block's output
  int grads;         // mark: backward reached the block's last linear
  int gather;        // its all-gather
  int reduce;        // its reduce-scatter
};

Positions Locate(const BackwardLog& log, int block) {
  const auto& ev = log.events;
  const int64_t n = log.units[block].padded_numel;
  const std::string b = "b" + std::to_string(block);
  auto is = [&](CommEvent::Kind k) {
    return [k, n](const CommEvent& e) { return e.kind == k && e.numel == n; };
  };
  auto mark = [&](const std::string& label) {
    return [label](const CommEvent& e) { return e.kind == CommEvent::Kind::kMark && e.label == label; };
  };
  const int gathers = static_cast<int>(std::count_if(ev.begin(), ev.end(), is(CommEvent::Kind::kAllGather)));
  EXPECT_EQ(gathers, 1) << b << " is gathered once in backward";
  return {Find(ev, mark("pre-backward " + b)), Find(ev, mark("grads " + b)),
          Find(ev, is(CommEvent::Kind::kAllGather)), Find(ev, is(CommEvent::Kind::kReduceScatter))};
}

TEST(BackwardPrefetch, EachModeIssuesTheNextGatherWhereItSays) {
  for (auto mode : {BackwardPrefetch::kBackwardPre, BackwardPrefetch::kBackwardPost, BackwardPrefetch::kNone}) {
    const BackwardLog log = RecordBackward(mode);
    ASSERT_EQ(log.units.size(), 5u);
    const std::string trace = std::string(BackwardPrefetchName(mode)) + ": " + shardtrain::testing::ToString(log.events);
    // Backward runs b3, b2, b1, b0: b_{i-1} is the unit after b_i.
    for (int i = 3; i >= 1; --i) {
      const Positions cur = Locate(log, i), next = Locate(log, i - 1);
      ASSERT_GE(cur.grads, 0) << trace;
      ASSERT_GE(cur.reduce, 0) << trace;
      ASSERT_GE(next.gather, 0) << trace;
      ASSERT_GE(next.pre_backward, 0) << trace;
      switch (mode) {
        case BackwardPrefetch::kBackwardPre:  // before b_i computes its gradients
          EXPECT_GT(next.gather, cur.pre_backward) << "b" << i << " " << trace;
          EXPECT_LT(next.gather, cur.grads) << "b" << i << " " << trace;
          break;
        case BackwardPrefetch::kBackwardPost:  // after b_i's gradients, before its reduce-scatter
          EXPECT_GT(next.gather, cur.grads) << "b" << i << " " << trace;
          EXPECT_LT(next.gather, cur.reduce) << "b" << i << " " << trace;
          break;
        default:  // only when backward reaches b_{i-1}, after b_i's reduce-scatter
          EXPECT_GT(next.gather, next.pre_backward) << "b" << i << " " << trace;
          EXPECT_GT(next.gather, cur.reduce) << "b" << i << " " << trace;
          break;
      }
    }
  }
}

// An outer unit holding three inner units: while an inner one computes, the
// outer one is unsharded too, so prefetching the next inner unit makes three
// unless limit_all_gathers stops it. Returns the most non-root units rank 0
// saw unsharded inside the inner blocks' forward and backward.
int MostUnshardedUnits(int limit_all_gathers) {
  int most = 0;
  RunRanks(2, [&](int rank, const auto& comm) {
    auto net = std::make_shared<NestedChainNetImpl>(8, 3);
    ShardingOptions o;
    o.forward_prefetch = true;
    o.backward_prefetch = BackwardPrefetch::kBackwardPre;
    o.limit_all_gathers = limit_all_gathers;
    ShardedModel sm(net, comm, o);
    ASSERT_EQ(sm.num_units(), 5);
    at::Tensor x = at::ones({4, 8});
    sm.Forward([&] { return net->forward(x); }).pow(2).mean().backward();  // records the order
    int mine = 0;
    auto probe = [&](int) {
      // The root stays gathered through forward and backward; the limit is on the others.
      const auto names = sm.UnshardedUnitNames();
      const int root = static_cast<int>(std::count(names.begin(), names.end(), "<root>"));
      EXPECT_EQ(sm.NumUnshardedUnits(), static_cast<int>(names.size()));
      mine = std::max(mine, sm.NumUnshardedUnits() - root);
    };
    g_hooks.on_forward = probe;
    g_hooks.on_grads = probe;
    for (int step = 0; step < 2; ++step) sm.Forward([&] { return net->forward(x); }).pow(2).mean().backward();
    g_hooks = {};
    if (rank == 0) most = mine;
  });
  return most;
}

// HYBRID_SHARD at W=4 (2 shard groups x 2 replicas): each unit's all-reduce
// across replicas starts during backward, not after it: on the CPU as soon as
// the core sees its reduce-scatter complete (polled from the gradient hooks),
// at the latest when two more reduce-scatters are in flight; one per unit, in
// the units' reduce order.
TEST(HybridShard, ReplicateAllReducesStartDuringBackward) {
  std::vector<CommEvent> events;
  std::vector<UnitInfo> units;
  RunRanks(4, [&](int rank, const auto& gloo) {
    auto rec = std::make_shared<RecordingCommunicator>(gloo);
    auto net = std::make_shared<ChainNetImpl>(std::vector<int64_t>{6, 8, 10, 12, 14});
    ShardingOptions o;
    o.sharding_strategy = ShardingStrategy::kHybridShard;
    o.hybrid_shard_group_size = 2;
    ShardedModel sm(net, rec, o);
    at::Tensor x = at::ones({4, 6});
    sm.Forward([&] { return net->forward(x); }).pow(2).mean().backward();
    g_hooks.on_grads = [&](int id) {
      rec->Mark("grads b" + std::to_string(id));
      if (id != 2) return;
      // b3's reduce-scatter (the only one launched) completes before b2's gradients arrive.
      const comm::WorkPtr b3 = rec->last_reduce_scatter();
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!b3->IsCompleted() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    };
    at::Tensor loss = sm.Forward([&] { return net->forward(x); }).pow(2).mean();
    rec->ClearEvents();
    loss.backward();
    g_hooks = {};
    if (rank == 0) {
      events = rec->events();
      units = sm.units();
    }
  });
  auto all_reduce_of = [&](int unit) {
    return Find(events, [n = units[unit].shard_numel](const CommEvent& e) {
      return e.kind == CommEvent::Kind::kAllReduce && e.numel == n;
    });
  };
  auto reduce_scatter_of = [&](int unit) {
    return Find(events, [n = units[unit].padded_numel](const CommEvent& e) {
      return e.kind == CommEvent::Kind::kReduceScatter && e.numel == n;
    });
  };
  const int grads_b0 =
      Find(events, [](const CommEvent& e) { return e.kind == CommEvent::Kind::kMark && e.label == "grads b0"; });
  ASSERT_GE(grads_b0, 0) << ToString(events);
  // b3 reduces first: its all-reduce goes out with b2's gradients, once its reduce-scatter has completed,
  // before b2's reduce-scatter (by launch count alone it would wait for b1's).
  EXPECT_GT(all_reduce_of(3), reduce_scatter_of(3)) << ToString(events);
  EXPECT_LT(all_reduce_of(3), reduce_scatter_of(2)) << ToString(events);
  EXPECT_LT(all_reduce_of(3), grads_b0) << ToString(events);
  EXPECT_LT(all_reduce_of(3), reduce_scatter_of(0)) << ToString(events);
  for (int u = 3; u > 0; --u) EXPECT_LT(all_reduce_of(u), all_reduce_of(u - 1)) << ToString(events);
  const auto all_reduces = std::count_if(events.begin(), events.end(),
                                         [](const CommEvent& e) { return e.kind == CommEvent::Kind::kAllReduce; });
  EXPECT_EQ(all_reduces, static_cast<long>(units.size())) << ToString(events);
}

TEST(LimitAllGathers, BoundsUnitsHoldingFullParameters) {
  EXPECT_EQ(MostUnshardedUnits(2), 2);
  EXPECT_EQ(MostUnshardedUnits(0), 3) << "without a limit, prefetching holds outer + computing + next";
}

}  // namespace
}  // namespace shardtrain::sharding
