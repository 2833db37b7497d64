// GlooCommunicator through shared memory between ranks on one host, over real
// Gloo on loopback, ranks as threads.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"
#include "tests/comm/gloo_test_values.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::comm {
namespace {

using shardtrain::testing::RunRanks;
using shardtrain::testing::RunRanksWithOptions;

// ---------------------------------------------------------------------------
// Shared memory between ranks on one host (GlooOptions::shared_memory). The
// suites above run with it by default; the tcp variant of this test binary
// (SHARDTRAIN_GLOO_SHM=0) runs them all over Gloo's TCP paths.

bool SharedMemoryWanted() {
  const char* env = std::getenv("SHARDTRAIN_GLOO_SHM");
  return !(env && std::string(env) == "0");
}

TEST(GlooSharedMemory, SameHostGroupsUseItUnlessAnyRankTurnsItOff) {
  RunRanks(4, [](int rank, const auto& comm) {
    EXPECT_EQ(comm->uses_shared_memory(), SharedMemoryWanted());
    HybridGroups g = comm->SplitHybrid(2);
    for (const CommunicatorPtr& sub : {g.shard, g.replicate}) {
      auto* gloo = dynamic_cast<GlooCommunicator*>(sub.get());
      ASSERT_NE(gloo, nullptr);
      EXPECT_EQ(gloo->uses_shared_memory(), SharedMemoryWanted());
    }
  });
  // One rank without it: no rank uses it (and none waits for the others).
  RunRanksWithOptions(
      2,
      [](int r) {
        GlooOptions o;
        o.shared_memory = r == 0;
        return o;
      },
      [](int rank, const auto& comm) {
        EXPECT_FALSE(comm->uses_shared_memory());
        at::Tensor t = at::full({5}, static_cast<float>(rank + 1));
        comm->AllReduce(t)->Wait();
        EXPECT_TRUE(at::equal(t, at::full({5}, 3.f)));
      });
  EXPECT_THROW(RunRanksWithOptions(
                   1,
                   [](int) {
                     GlooOptions o;
                     o.shared_memory_ring_bytes = 1000;
                     return o;
                   },
                   [](int, const auto&) {}),
               InvalidArgumentError);
}

// Buffers many times the ring, sizes not divisible by W=3, every op and
// 16-bit type: exact values; ranks agree bit for bit on all-reduce results.
TEST(GlooSharedMemory, LargeBuffersThroughSmallRingsAtOddWorldSize) {
  constexpr int kWorld = 3;
  const int64_t n = 100003;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
    std::vector<at::Tensor> reduced(kWorld);
    RunRanksWithOptions(
        kWorld,
        [](int) {
          GlooOptions o;
          o.shared_memory_ring_bytes = 64 << 10;
          return o;
        },
        [&](int rank, const auto& comm) {
          EXPECT_EQ(comm->uses_shared_memory(), SharedMemoryWanted());
          at::Tensor full = at::empty({kWorld * n}, dtype);
          comm->AllGather(Pattern(n, rank, dtype), full)->Wait();
          for (int r = 0; r < kWorld; ++r)
            EXPECT_TRUE(at::equal(full.slice(0, r * n, (r + 1) * n), Pattern(n, r, dtype)));

          at::Tensor shard = at::empty({n}, dtype);
          comm->ReduceScatter(Pattern(kWorld * n, rank, dtype), shard)->Wait();
          at::Tensor expected = at::zeros({n}, at::kDouble);
          for (int r = 0; r < kWorld; ++r)
            expected += Pattern(kWorld * n, r, at::kDouble).slice(0, rank * n, (rank + 1) * n);
          EXPECT_TRUE(at::equal(shard, expected.to(dtype)));

          // In place: the output is this rank's block of the input.
          at::Tensor buffer = Pattern(kWorld * n, rank, dtype);
          comm->ReduceScatter(buffer, buffer.slice(0, rank * n, (rank + 1) * n))->Wait();
          EXPECT_TRUE(at::equal(buffer.slice(0, rank * n, (rank + 1) * n), expected.to(dtype)));

          at::Tensor t = Pattern(n, rank, dtype);
          comm->AllReduce(t)->Wait();
          at::Tensor sum = at::zeros({n}, at::kDouble);
          for (int r = 0; r < kWorld; ++r) sum += Pattern(n, r, at::kDouble);
          EXPECT_TRUE(at::equal(t, sum.to(dtype)));
          at::Tensor u = RandomValues(n, dtype, 5 + rank);
          comm->AllReduce(u, {ReduceOp::kAvg})->Wait();
          reduced[rank] = u;
          const int64_t per_call = 2 * (kWorld - 1) * n * u.element_size() / kWorld;
          EXPECT_EQ(comm->stats().BytesSent(CommOp::kAllReduce), 2 * per_call);
        });
    for (int r = 1; r < kWorld; ++r)
      EXPECT_TRUE(BitEqual(reduced[r], reduced[0])) << c10::toString(dtype) << " rank " << r;
  }
}

// Cuts `full` into pieces of irregular sizes (empty ones, ones across block
// boundaries, single elements) that together are `full`, each its own tensor.
std::vector<at::Tensor> IrregularPieces(const at::Tensor& full) {
  std::vector<at::Tensor> pieces;
  const int64_t sizes[] = {0, 1, 7, 0, 4099, 3, 65536, 1, 12345};
  int64_t pos = 0;
  for (int i = 0; pos < full.numel(); ++i) {
    const int64_t k = std::min(sizes[i % 9], full.numel() - pos);
    pieces.push_back(full.narrow(0, pos, k).clone());
    pos += k;
  }
  pieces.push_back(at::empty({0}, full.options()));
  return pieces;
}

// The reduce-scatter of pieces read where they lie (shared memory) gives the
// bits of the reduce-scatter of their concatenation, through rings smaller
// than the data, at W=2 (one pass per piece) and W=3 (an accumulator); with
// shared memory off the pieces are concatenated first, with the same result.
TEST(GlooSharedMemory, ReduceScatterOfPiecesEqualsThatOfTheirConcatenation) {
  for (const bool shm : {true, false}) {
    for (const int world : {2, 3}) {
      const int64_t n = 50003;
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
        RunRanksWithOptions(
            world,
            [shm](int) {
              GlooOptions o;
              o.shared_memory = shm;
              o.shared_memory_ring_bytes = 64 << 10;
              return o;
            },
            [&](int rank, const auto& comm) {
              const std::string what = std::string(c10::toString(dtype)) + " W=" + std::to_string(world) +
                                       (shm ? " shm" : " tcp") + " rank " + std::to_string(rank);
              EXPECT_EQ(comm->ReadsPiecesInPlace(), shm && SharedMemoryWanted()) << what;
              const at::Tensor full = RandomValues(world * n, dtype, 40 + rank);
              ReduceOptions o;
              o.op = ReduceOp::kAvg;
              o.pre_divide = 2.0;
              at::Tensor expected = at::empty({n}, dtype), got = at::full({n}, 7.0, dtype);
              comm->ReduceScatter(full, expected, o)->Wait();
              const std::vector<at::Tensor> pieces = IrregularPieces(full);
              const std::vector<at::Tensor> before = IrregularPieces(full);
              comm->ReduceScatterPieces(pieces, got, o)->Wait();
              EXPECT_TRUE(BitEqual(got, expected)) << what;
              for (size_t i = 0; i < pieces.size(); ++i) EXPECT_TRUE(BitEqual(pieces[i], before[i])) << what;
              EXPECT_EQ(comm->stats().Calls(CommOp::kReduceScatter), 2);
              EXPECT_EQ(comm->stats().BytesSent(CommOp::kReduceScatter), 2 * (world - 1) * n * got.element_size());
              // Bad pieces name what is wrong.
              EXPECT_THROW(comm->ReduceScatterPieces({full.narrow(0, 1, world * n - 1)}, got), InvalidArgumentError);
              EXPECT_THROW(comm->ReduceScatterPieces({full.to(at::kLong)}, got), InvalidArgumentError);
            });
      }
    }
  }
}

// A communicator destroyed with a collective in flight (its peer never
// joins) returns at once instead of after the 30-minute timeout; the peer's
// next collective fails naming the closed rank.
TEST(GlooSharedMemory, DestroyingWithACollectiveInFlightReturnsPromptly) {
  if (!SharedMemoryWanted()) GTEST_SKIP() << "shared memory is off (SHARDTRAIN_GLOO_SHM=0)";
  std::atomic<bool> rank0_gone{false};
  RunRanksWithOptions(
      2, [](int) { return GlooOptions{}; },
      [&](int rank, auto comm) {
        if (rank == 0) {
          WorkPtr work = comm->AllGather(at::ones({1 << 20}), at::empty({2 << 20}));
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          const auto start = std::chrono::steady_clock::now();
          comm.reset();
          EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
          EXPECT_THROW(work->Wait(), CommError);
          rank0_gone = true;
          return;
        }
        while (!rank0_gone) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        try {
          comm->AllGather(at::ones({1 << 20}), at::empty({2 << 20}))->Wait();
          ADD_FAILURE() << "expected CommError";
        } catch (const CommError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("AllGather on gloo group 'world' (rank 1/2) failed"), std::string::npos) << msg;
          EXPECT_NE(msg.find("rank 0 of group 'world' has closed its communicator"), std::string::npos) << msg;
          EXPECT_NE(msg.find("Shared memory: rank 0 left the shared memory mesh"), std::string::npos) << msg;
        }
      });
}

// The end of a job: every rank destroys its communicator right after its
// last collective (a W=4 16-bit reduce-scatter, whose ordered sum takes a
// peer's bytes only after the lower ranks'), the last rank starting late.
// A peer that closed after finishing is no failure on a slower rank. Small
// rings make the ranks trade many chunks, so the last ones often meet a
// closing peer; over TCP (the tcp variant) Gloo sees the closes instead.
TEST(GlooSharedMemory, PeersClosingRightAfterTheirLastCollectiveFailNoRank) {
  constexpr int kWorld = 4;
  const int64_t n = 8192;
  for (int i = 0; i < 6; ++i) {
    const at::ScalarType dtype = i % 2 ? at::kBFloat16 : at::kHalf;
    RunRanksWithOptions(
        kWorld,
        [](int) {
          GlooOptions o;
          o.shared_memory_ring_bytes = 4096;
          return o;
        },
        [&](int rank, auto comm) {
          if (rank == kWorld - 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
          at::Tensor shard = at::empty({n}, dtype);
          comm->ReduceScatter(Pattern(kWorld * n, rank, dtype), shard)->Wait();
          comm.reset();  // at once, as a rank that finished training
          at::Tensor expected = at::zeros({n}, at::kDouble);
          for (int r = 0; r < kWorld; ++r)
            expected += Pattern(kWorld * n, r, at::kDouble).slice(0, rank * n, (rank + 1) * n);
          EXPECT_TRUE(at::equal(shard, expected.to(dtype))) << "iteration " << i << " rank " << rank;
        });
  }
}

}  // namespace
}  // namespace shardtrain::comm
