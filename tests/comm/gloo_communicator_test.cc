// GlooCommunicator over real Gloo on loopback, ranks as threads.
#include "comm/gloo_communicator.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <thread>

#include "comm/errors.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::comm {
namespace {

using shardtrain::testing::RunRanks;

struct Case {
  int world;
  at::ScalarType dtype;
};

class GlooCollectives : public ::testing::TestWithParam<Case> {};

// Small integers: exact in float32, float16 and bfloat16 (all sums <= 256).
at::Tensor Pattern(int64_t n, int rank, at::ScalarType dtype) {
  return (at::arange(n, at::kDouble).remainder(7) + 1 + 10 * rank).to(dtype);
}

TEST_P(GlooCollectives, AllGatherPlacesEachRanksShard) {
  const auto [world, dtype] = GetParam();
  const int64_t n = 13;  // not divisible by any W > 1
  RunRanks(world, [&, world = world, dtype = dtype](int rank, const auto& comm) {
    at::Tensor shard = Pattern(n, rank, dtype);
    at::Tensor full = at::empty({world * n}, dtype);
    comm->AllGather(shard, full)->Wait();
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(at::equal(full.slice(0, r * n, (r + 1) * n), Pattern(n, r, dtype))) << "block " << r;
    }
    EXPECT_EQ(comm->stats().BytesSent(CommOp::kAllGather), (world - 1) * n * shard.element_size());
    EXPECT_EQ(comm->stats().Calls(CommOp::kAllGather), 1);
  });
}

TEST_P(GlooCollectives, ReduceScatterSumsBlocks) {
  const auto [world, dtype] = GetParam();
  const int64_t n = 11;
  RunRanks(world, [&, world = world, dtype = dtype](int rank, const auto& comm) {
    at::Tensor full = Pattern(world * n, rank, dtype);
    at::Tensor shard = at::empty({n}, dtype);
    comm->ReduceScatter(full, shard)->Wait();
    at::Tensor expected = at::zeros({n}, at::kDouble);
    for (int r = 0; r < world; ++r) expected += Pattern(world * n, r, at::kDouble).slice(0, rank * n, (rank + 1) * n);
    EXPECT_TRUE(at::equal(shard, expected.to(dtype))) << shard << expected;
    EXPECT_EQ(comm->stats().BytesSent(CommOp::kReduceScatter), (world - 1) * n * shard.element_size());
  });
}

TEST_P(GlooCollectives, ReduceScatterAvgWithDivideFactors) {
  const auto [world, dtype] = GetParam();
  const int64_t n = 6;
  RunRanks(world, [&, world = world, dtype = dtype](int rank, const auto& comm) {
    at::Tensor full = Pattern(world * n, rank, dtype);
    at::Tensor shard = at::empty({n}, dtype);
    ReduceOptions o;
    o.op = ReduceOp::kAvg;
    o.pre_divide = 2.0;
    o.post_divide = 4.0;
    comm->ReduceScatter(full, shard, o)->Wait();
    at::Tensor expected = at::zeros({n}, at::kDouble);
    for (int r = 0; r < world; ++r) expected += Pattern(world * n, r, at::kDouble).slice(0, rank * n, (rank + 1) * n);
    expected /= 8.0 * world;
    const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
    EXPECT_TRUE(at::allclose(shard.to(at::kDouble), expected, tol, 0)) << shard << expected;
  });
}

TEST_P(GlooCollectives, AllReduceSumAvgMax) {
  const auto [world, dtype] = GetParam();
  const int64_t n = 9;
  RunRanks(world, [&, world = world, dtype = dtype](int rank, const auto& comm) {
    at::Tensor expected = at::zeros({n}, at::kDouble);
    for (int r = 0; r < world; ++r) expected += Pattern(n, r, at::kDouble);

    at::Tensor t = Pattern(n, rank, dtype);
    comm->AllReduce(t)->Wait();
    EXPECT_TRUE(at::equal(t, expected.to(dtype)));

    t = Pattern(n, rank, dtype);
    comm->AllReduce(t, {ReduceOp::kAvg})->Wait();
    EXPECT_TRUE(at::allclose(t.to(at::kDouble), expected / world, dtype == at::kFloat ? 1e-6 : 1e-2, 0));

    t = Pattern(n, rank, dtype);
    comm->AllReduce(t, {ReduceOp::kMax})->Wait();
    EXPECT_TRUE(at::equal(t, Pattern(n, world - 1, dtype)));
  });
}

TEST_P(GlooCollectives, BroadcastFromLastRankAndBarrier) {
  const auto [world, dtype] = GetParam();
  RunRanks(world, [&, world = world, dtype = dtype](int rank, const auto& comm) {
    at::Tensor t = Pattern(17, rank, dtype);
    comm->Broadcast(t, world - 1)->Wait();
    EXPECT_TRUE(at::equal(t, Pattern(17, world - 1, dtype)));
    comm->Barrier()->Wait();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldsAndDtypes, GlooCollectives,
                         ::testing::Values(Case{1, at::kFloat}, Case{2, at::kFloat}, Case{3, at::kFloat},
                                           Case{4, at::kFloat}, Case{2, at::kBFloat16}, Case{3, at::kBFloat16},
                                           Case{4, at::kBFloat16}, Case{2, at::kHalf}, Case{3, at::kHalf},
                                           Case{4, at::kHalf}),
                         [](const auto& info) {
                           return "W" + std::to_string(info.param.world) + "_" +
                                  std::string(c10::toString(info.param.dtype));
                         });

TEST(GlooSubgroups, HybridTwoByTwo) {
  RunRanks(4, [](int rank, const auto& comm) {
    HybridGroups g = comm->SplitHybrid(2);
    ASSERT_TRUE(g.shard && g.replicate);
    EXPECT_EQ(g.shard->size(), 2);
    EXPECT_EQ(g.shard->rank(), rank % 2);
    EXPECT_EQ(g.replicate->rank(), rank / 2);
    at::Tensor t = at::full({3}, static_cast<double>(1 << rank), at::kFloat);
    g.shard->AllReduce(t)->Wait();  // {0,1} -> 3, {2,3} -> 12
    EXPECT_EQ(t[0].item<float>(), rank < 2 ? 3.f : 12.f);
    at::Tensor u = at::full({3}, static_cast<double>(1 << rank), at::kFloat);
    g.replicate->AllReduce(u)->Wait();  // {0,2} -> 5, {1,3} -> 10
    EXPECT_EQ(u[0].item<float>(), rank % 2 == 0 ? 5.f : 10.f);
    EXPECT_NE(g.shard->name().find("shard"), std::string::npos);
  });
}

TEST(GlooErrors, BadInputIsAClearError) {
  RunRanks(2, [](int rank, const auto& comm) {
    at::Tensor shard = at::zeros({4});
    try {
      comm->AllGather(shard, at::zeros({7}));
      FAIL() << "expected InvalidArgumentError";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("must have 2 x shard elements = 8, got 7"), std::string::npos) << e.what();
    }
    EXPECT_THROW(comm->AllGather(shard, at::zeros({8}, at::kDouble)), InvalidArgumentError);
    EXPECT_THROW(comm->ReduceScatter(at::zeros({8}), at::zeros({3})), InvalidArgumentError);
    EXPECT_THROW(comm->AllReduce(at::zeros({4}, at::kComplexFloat)), InvalidArgumentError);
    EXPECT_THROW(comm->Broadcast(shard, 2), InvalidArgumentError);
    EXPECT_THROW(comm->AllReduce(at::zeros({4, 4}).t()), InvalidArgumentError);
    EXPECT_THROW(comm->NewGroup({1, 0}, "x"), InvalidArgumentError);
  });
}

TEST(GlooErrors, MissingPeerTimesOutWithClearError) {
  auto start = std::chrono::steady_clock::now();
  std::atomic<bool> rank0_done{false};
  RunRanks(
      2,
      [&](int rank, const auto& comm) {
        if (rank == 1) {  // never joins the collective, stays alive until rank 0 gave up
          while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          return;
        }
        try {
          comm->AllGather(at::ones({4}), at::empty({8}))->Wait();
          ADD_FAILURE() << "expected a timeout";
        } catch (const CommError& e) {
          std::string msg = e.what();
          EXPECT_NE(msg.find("AllGather on gloo group 'world' (rank 0/2)"), std::string::npos) << msg;
        }
        rank0_done = true;
      },
      std::chrono::milliseconds(1500));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

TEST(GlooErrors, DeadPeerFailsSurvivor) {
  std::atomic<bool> rank1_gone{false};
  RunRanks(
      2,
      [&](int rank, const auto& comm) {
        if (rank == 1) {
          rank1_gone = true;
          return;  // destroying the communicator closes its connections
        }
        while (!rank1_gone) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        EXPECT_THROW(comm->AllReduce(at::ones({1024}))->Wait(), CommError);
      },
      std::chrono::milliseconds(3000));
}

TEST(GlooErrors, MismatchedCallsAcrossRanksAreAClearError) {
  RunRanks(
      2,
      [&](int rank, const auto& comm) {
        const int64_t n = rank == 0 ? 4 : 5;
        try {
          comm->AllGather(at::ones({n}), at::empty({2 * n}))->Wait();
          ADD_FAILURE() << "expected InvalidArgumentError";
        } catch (const InvalidArgumentError& e) {
          EXPECT_NE(std::string(e.what()).find("rank 0: all_gather of 4 x Float; rank 1: all_gather of 5 x Float"),
                    std::string::npos)
              << e.what();
        }
        // A different dtype, and a different operation, are caught the same way.
        at::Tensor t = at::ones({4}, rank == 0 ? at::kFloat : at::kBFloat16);
        EXPECT_THROW(comm->AllReduce(t)->Wait(), InvalidArgumentError);
        if (rank == 0) {
          EXPECT_THROW(comm->AllReduce(at::ones({4}))->Wait(), InvalidArgumentError);
        } else {
          EXPECT_THROW(comm->Broadcast(at::ones({4}), 0)->Wait(), InvalidArgumentError);
        }
        comm->Barrier()->Wait();  // the group is still usable afterwards
      },
      std::chrono::milliseconds(2000));
}

}  // namespace
}  // namespace shardtrain::comm
