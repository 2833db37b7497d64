// GlooCommunicator over real Gloo on loopback, ranks as threads.
#include "comm/gloo_communicator.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "comm/rendezvous.h"
#include "tests/comm/gloo_test_values.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::comm {
namespace {

using shardtrain::testing::RunRanks;
using shardtrain::testing::RunRanksWithOptions;

struct Case {
  int world;
  at::ScalarType dtype;
};

class GlooCollectives : public ::testing::TestWithParam<Case> {};


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


// W=2 all-reduce on both sides of the direct-exchange limit (2 MiB: up to it
// the exchange, above it Gloo's ring): bit for bit what Gloo's sum gives (each
// input divided by pre_divide in its dtype, one add per element rounded once,
// the sum divided by post_divide x W for AVG), and the same on both ranks.
TEST(GlooAllReduce, TwoRanksMatchGloosArithmeticBitForBit) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
    const int64_t limit = (int64_t{2} << 20) / static_cast<int64_t>(c10::elementSize(dtype));  // 2 MiB
    for (int64_t n : {limit, limit + 1, int64_t{3}}) {
      const std::vector<at::Tensor> inputs = {RandomValues(n, dtype, 11), RandomValues(n, dtype, 12)};
      for (const ReduceOptions& o :
           {ReduceOptions{}, ReduceOptions{ReduceOp::kAvg, 2.0, 3.0}, ReduceOptions{ReduceOp::kSum, 1.0, 7.0}}) {
        std::vector<at::Tensor> results(2);
        RunRanks(2, [&](int rank, const auto& comm) {
          at::Tensor t = inputs[rank].clone();
          comm->AllReduce(t, o)->Wait();
          results[rank] = t;
          EXPECT_EQ(comm->stats().BytesSent(CommOp::kAllReduce), n * t.element_size());
        });
        at::Tensor a = inputs[0].clone(), b = inputs[1].clone();
        if (o.pre_divide != 1.0) {
          a.div_(o.pre_divide);
          b.div_(o.pre_divide);
        }
        // Gloo's sum of 16-bit types: in float32, rounded once.
        const bool low = dtype == at::kBFloat16 || dtype == at::kHalf;
        at::Tensor expected = low ? (a.to(at::kFloat) + b.to(at::kFloat)).to(dtype) : a + b;
        const double post = o.post_divide * (o.op == ReduceOp::kAvg ? 2 : 1);
        if (post != 1.0) expected.div_(post);
        const std::string what = internal::StrCat(c10::toString(dtype), " n=", n, " ", ReduceOpName(o.op), " pre ",
                                                  o.pre_divide, " post ", o.post_divide);
        EXPECT_TRUE(BitEqual(results[0], results[1])) << what << ": ranks disagree";
        EXPECT_TRUE(BitEqual(results[0], expected)) << what;
      }
    }
  }
}

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

// With verify_calls off (no signature exchange) collectives give the same
// exact results; over TCP (the tcp variant) they start on the caller's thread,
// with shared memory on the issuing thread, which moves the bytes.
TEST(GlooCollectives, WithoutVerificationStartOnTheCallersThread) {
  RunRanksWithOptions(
      2,
      [](int) {
        GlooOptions o;
        o.verify_calls = false;
        return o;
      },
      [](int r, auto c) {
        at::Tensor gathered = at::empty({6});
        c->AllGather(at::full({3}, static_cast<float>(r + 1)), gathered)->Wait();
        EXPECT_TRUE(at::equal(gathered, at::tensor({1.f, 1.f, 1.f, 2.f, 2.f, 2.f})));
        at::Tensor shard = at::empty({2});
        c->ReduceScatter(at::arange(4, at::kFloat) * (r + 1), shard)->Wait();  // (0,1,2,3) + (0,2,4,6)
        EXPECT_TRUE(at::equal(shard, r == 0 ? at::tensor({0.f, 3.f}) : at::tensor({6.f, 9.f})));
        at::Tensor t = at::full({5}, static_cast<float>(r + 1));
        c->AllReduce(t, {ReduceOp::kAvg})->Wait();
        EXPECT_TRUE(at::equal(t, at::full({5}, 1.5f)));
        c->Barrier()->Wait();
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
        } catch (const CommTimeoutError& e) {
          std::string msg = e.what();
          EXPECT_NE(msg.find("AllGather on gloo group 'world' (rank 0/2) timed out after 1500 ms"), std::string::npos)
              << msg;
          // The heartbeat names the peer and says why: alive, but behind.
          EXPECT_NE(msg.find("rank 1 of group 'world' is alive (heartbeat "), std::string::npos) << msg;
          EXPECT_NE(msg.find("has issued 0 collectives while this rank is at #1 (AllGather): it has not reached "
                             "this collective"),
                    std::string::npos)
              << msg;
        }
        rank0_done = true;
      },
      std::chrono::milliseconds(1500));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// A rank that stops after some collectives: the survivor's error says how far it got.
TEST(GlooErrors, StalledPeerIsNamedWithItsProgress) {
  std::atomic<bool> rank0_done{false};
  RunRanks(
      2,
      [&](int rank, const auto& comm) {
        for (int i = 0; i < 3; ++i) comm->Barrier()->Wait();
        if (rank == 1) {
          comm->AllGather(at::ones({4}), at::empty({8}))->Wait();
          while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          return;
        }
        comm->AllGather(at::ones({4}), at::empty({8}))->Wait();
        try {
          at::Tensor t = at::ones({1 << 18});  // 1 MiB: the W=2 direct exchange
          comm->AllReduce(t)->Wait();
          ADD_FAILURE() << "expected a timeout";
        } catch (const CommTimeoutError& e) {
          std::string msg = e.what();
          EXPECT_NE(msg.find("AllReduce on gloo group 'world' (rank 0/2) timed out after 1500 ms (collective #5 of "
                             "this rank): rank 1 of group 'world' is alive"),
                    std::string::npos)
              << msg;
          EXPECT_NE(msg.find("has issued 4 collectives while this rank is at #5 (AllReduce): it has not reached this "
                             "collective (its latest: AllGather)"),
                    std::string::npos)
              << msg;
        }
        rank0_done = true;
      },
      std::chrono::milliseconds(1500));
}

TEST(GlooErrors, DeadPeerFailsSurvivor) {
  std::atomic<bool> rank1_gone{false};
  RunRanks(
      2,
      [&](int rank, const auto& comm) {
        if (rank == 1) {
          comm->Barrier()->Wait();
          rank1_gone = true;
          return;  // destroying the communicator closes its connections
        }
        comm->Barrier()->Wait();
        while (!rank1_gone) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        try {
          comm->AllReduce(at::ones({1024}))->Wait();
          ADD_FAILURE() << "expected CommError";
        } catch (const CommError& e) {
          std::string msg = e.what();
          EXPECT_NE(msg.find("AllReduce on gloo group 'world' (rank 0/2)"), std::string::npos) << msg;
          EXPECT_NE(msg.find("rank 1 of group 'world' has closed its communicator (1 collective issued, the latest "
                             "Barrier)"),
                    std::string::npos)
              << msg;
        }
      },
      std::chrono::milliseconds(3000));
}

// A collective that fails because a peer closed names that peer; a live
// peer that has not issued the collective yet is only listed as alive (in a
// failure that is no timeout, being behind is no fault: the ranks' skew, or a
// heartbeat older than the peer's issue, would name a rank that did no wrong).
TEST(GlooErrors, PeerBehindIsNoCulpritWhenAnotherClosed) {
  std::atomic<bool> rank0_done{false};
  RunRanksWithOptions(
      3,
      [](int) {
        GlooOptions o;
        o.timeout = std::chrono::milliseconds(5000);
        o.heartbeat_period = std::chrono::milliseconds(100);  // stale (dead or hung) after 300 ms
        return o;
      },
      [&](int rank, auto comm) {
        comm->Barrier()->Wait();
        if (rank == 1) {  // alive, heartbeats fresh, never issues collective #2
          while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return;
        }
        if (rank == 2) {  // closes 500 ms after rank 0 issued #2: rank 1's heartbeats postdate the issue
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
          return;
        }
        try {
          comm->AllReduce(at::ones({1024}))->Wait();
          ADD_FAILURE() << "expected CommError";
        } catch (const CommTimeoutError& e) {
          ADD_FAILURE() << "expected no timeout: " << e.what();
        } catch (const CommError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("rank 2 of group 'world' has closed its communicator"), std::string::npos) << msg;
          EXPECT_NE(msg.find("rank 1 of group 'world' is alive"), std::string::npos) << msg;
          EXPECT_EQ(msg.find("has not reached"), std::string::npos) << msg;
        }
        rank0_done = true;
      });
}

// Sub-groups publish heartbeats under their own names; with heartbeats off,
// errors still name operation and group.
TEST(GlooErrors, SubgroupPeerIsNamedAndHeartbeatsCanBeOff) {
  std::atomic<int> done{0};
  RunRanks(
      4,
      [&](int rank, const auto& comm) {
        HybridGroups g = comm->SplitHybrid(2);
        if (rank == 1) {  // rank 0 of "world/shard0" waits for it in vain
          while (done < 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          return;
        }
        if (rank == 0) {
          try {
            g.shard->Barrier()->Wait();
            ADD_FAILURE() << "expected a timeout";
          } catch (const CommTimeoutError& e) {
            std::string msg = e.what();
            EXPECT_NE(msg.find("Barrier on gloo group 'world/shard0' (rank 0/2) timed out"), std::string::npos) << msg;
            EXPECT_NE(msg.find("rank 1 of group 'world/shard0' is alive"), std::string::npos) << msg;
          }
          ++done;
        }
      },
      std::chrono::milliseconds(1500));

  RunRanksWithOptions(
      2,
      [](int) {
        GlooOptions o;
        o.timeout = std::chrono::milliseconds(1000);
        o.heartbeat_period = std::chrono::milliseconds(0);
        return o;
      },
      [](int r, auto c) {
        if (r == 1) return;
        try {
          c->Barrier()->Wait();
          ADD_FAILURE() << "expected CommError";
        } catch (const CommError& e) {
          std::string msg = e.what();
          EXPECT_NE(msg.find("Barrier on gloo group 'world' (rank 0/2)"), std::string::npos) << msg;
          EXPECT_NE(msg.find("a peer rank may have died or not reached this collective"), std::string::npos) << msg;
        }
      });
  GlooOptions bad;
  bad.heartbeat_period = std::chrono::milliseconds(-1);
  try {
    GlooCommunicator::Create(CreateHashStore(), 0, 1, bad);
    ADD_FAILURE() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("GlooOptions.heartbeat_period must be >= 0 ms (0: off), got -1 ms"),
              std::string::npos)
        << e.what();
  }
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
