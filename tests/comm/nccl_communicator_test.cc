// NcclCommunicator at world size 1 (HashStore): every collective goes through
// NCCL on the communicator's own stream; values are checked exactly in
// float32 and bfloat16. Skips itself when no CUDA device is visible.
//
// Built by Bazel with GoogleTest (//tests/comm:nccl_communicator_test,
// --config=cuda), or with -DST_NO_GTEST and the small stand-in below where
// GoogleTest is missing (bench/gpu/CMakeLists.txt).
#include "comm/nccl_communicator.h"

#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"

#ifndef ST_NO_GTEST
#include <gtest/gtest.h>
#else
// A stand-in for the few GoogleTest macros used here: TEST, EXPECT_TRUE,
// EXPECT_EQ, ASSERT_TRUE, EXPECT_THROW, GTEST_SKIP (all with `<< message`).
#include <cstdio>
#include <exception>
#include <sstream>

namespace st_mini_test {
struct TestCase {
  const char* name;
  void (*fn)();
};
inline std::vector<TestCase>& Tests() {
  static std::vector<TestCase> tests;
  return tests;
}
inline int& Failures() {
  static int n = 0;
  return n;
}
inline bool& Skipped() {
  static bool s = false;
  return s;
}
struct Registrar {
  Registrar(const char* name, void (*fn)()) { Tests().push_back({name, fn}); }
};
struct Message {
  std::ostringstream os;
  template <typename T>
  Message& operator<<(const T& v) {
    os << v;
    return *this;
  }
};
struct FailSink {
  const char* file;
  int line;
  const char* cond;
  void operator=(const Message& m) const {
    ++Failures();
    std::fprintf(stderr, "%s:%d: Failure: %s %s\n", file, line, cond, m.os.str().c_str());
  }
};
struct SkipSink {
  void operator=(const Message& m) const {
    Skipped() = true;
    std::fprintf(stderr, "  skipped: %s\n", m.os.str().c_str());
  }
};
}  // namespace st_mini_test

#define ST_MT_BLOCKER_ \
  switch (0)           \
  case 0:              \
  default:
#define TEST(suite, name)                                                                    \
  static void suite##_##name##_Body();                                                       \
  static ::st_mini_test::Registrar suite##_##name##_registrar(#suite "." #name, &suite##_##name##_Body); \
  static void suite##_##name##_Body()
#define EXPECT_TRUE(c) \
  ST_MT_BLOCKER_ if (c) {} else ::st_mini_test::FailSink{__FILE__, __LINE__, #c} = ::st_mini_test::Message()
#define EXPECT_EQ(a, b)                                                                           \
  ST_MT_BLOCKER_ if ((a) == (b)) {} else ::st_mini_test::FailSink{__FILE__, __LINE__, #a " == " #b} = \
      ::st_mini_test::Message()
#define ASSERT_TRUE(c) \
  ST_MT_BLOCKER_ if (c) {} else return ::st_mini_test::FailSink{__FILE__, __LINE__, #c} = ::st_mini_test::Message()
#define EXPECT_THROW(stmt, type)                                                                  \
  do {                                                                                            \
    bool st_mt_caught_ = false;                                                                   \
    try {                                                                                         \
      stmt;                                                                                       \
    } catch (const type&) {                                                                       \
      st_mt_caught_ = true;                                                                       \
    } catch (const std::exception& e) {                                                           \
      ::st_mini_test::FailSink{__FILE__, __LINE__, #stmt " throws " #type} = ::st_mini_test::Message() \
                                                                          << "; threw: " << e.what(); \
      st_mt_caught_ = true;                                                                       \
    }                                                                                             \
    if (!st_mt_caught_)                                                                           \
      ::st_mini_test::FailSink{__FILE__, __LINE__, #stmt " throws " #type} = ::st_mini_test::Message() \
                                                                          << "; threw nothing";   \
  } while (0)
#define GTEST_SKIP() return ::st_mini_test::SkipSink() = ::st_mini_test::Message()

int main() {
  int failed_tests = 0;
  for (const auto& t : st_mini_test::Tests()) {
    std::fprintf(stderr, "[ RUN      ] %s\n", t.name);
    const int before = st_mini_test::Failures();
    st_mini_test::Skipped() = false;
    try {
      t.fn();
    } catch (const std::exception& e) {
      ++st_mini_test::Failures();
      std::fprintf(stderr, "  uncaught exception: %s\n", e.what());
    }
    const bool ok = st_mini_test::Failures() == before;
    failed_tests += ok ? 0 : 1;
    std::fprintf(stderr, "[ %s ] %s\n", !ok ? " FAILED " : st_mini_test::Skipped() ? " SKIPPED" : "      OK", t.name);
  }
  std::fprintf(stderr, "%zu tests, %d failed\n", st_mini_test::Tests().size(), failed_tests);
  return failed_tests == 0 ? 0 : 1;
}
#endif  // ST_NO_GTEST

namespace shardtrain::comm {
namespace {

#define REQUIRE_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible"

std::shared_ptr<NcclCommunicator> MakeWorld(NcclOptions options = {}) {
  return NcclCommunicator::Create(c10::make_intrusive<c10d::HashStore>(), 0, 1, options);
}

at::TensorOptions Cuda(at::ScalarType dtype) { return at::TensorOptions().dtype(dtype).device(at::kCUDA, 0); }

// Multiples of 8 in [8, 128]: exact in bfloat16 after dividing by up to 8.
at::Tensor Pattern(int64_t n, at::ScalarType dtype) {
  return ((at::arange(n, at::kDouble).remainder(16) + 1) * 8).to(Cuda(dtype));
}

// Exact comparison on the host in double.
bool Same(const at::Tensor& got, const at::Tensor& expected) {
  return at::equal(got.cpu().to(at::kDouble), expected.cpu().to(at::kDouble));
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16};

TEST(NcclCommunicatorTest, CreatesAWorldOfOne) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->backend(), std::string("nccl"));
  EXPECT_EQ(comm->name(), std::string("world"));
  EXPECT_EQ(comm->device(), 0);
}

TEST(NcclCommunicatorTest, AllGatherCopiesTheShard) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  for (at::ScalarType dtype : kDtypes) {
    const int64_t n = 13;
    at::Tensor shard = Pattern(n, dtype);
    at::Tensor full = at::zeros({n}, Cuda(dtype));
    comm->AllGather(shard, full)->Wait();
    EXPECT_TRUE(Same(full, shard)) << dtype << ": " << full;
  }
  EXPECT_EQ(comm->stats().Calls(CommOp::kAllGather), 2);
  EXPECT_EQ(comm->stats().BytesSent(CommOp::kAllGather), 0);
}

TEST(NcclCommunicatorTest, ReduceScatterSumAvgAndDivideFactors) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  struct Case {
    ReduceOp op;
    double pre, post, divisor;  // expected = input / divisor at W = 1
  };
  const std::vector<Case> cases = {
      {ReduceOp::kSum, 1, 1, 1}, {ReduceOp::kAvg, 1, 1, 1}, {ReduceOp::kSum, 2, 4, 8},
      {ReduceOp::kAvg, 2, 4, 8}, {ReduceOp::kAvg, 1, 4, 4}, {ReduceOp::kSum, 8, 1, 8},
  };
  for (at::ScalarType dtype : kDtypes) {
    for (const Case& c : cases) {
      const int64_t n = 11;
      at::Tensor full = Pattern(n, dtype);
      at::Tensor before = full.clone();
      at::Tensor shard = at::zeros({n}, Cuda(dtype));
      ReduceOptions o;
      o.op = c.op;
      o.pre_divide = c.pre;
      o.post_divide = c.post;
      comm->ReduceScatter(full, shard, o)->Wait();
      EXPECT_TRUE(Same(shard, before.to(at::kDouble) / c.divisor))
          << dtype << " " << ReduceOpName(c.op) << " pre " << c.pre << " post " << c.post << ": " << shard;
      EXPECT_TRUE(Same(full, before)) << "the input must not change";
    }
  }
  EXPECT_EQ(comm->stats().Calls(CommOp::kReduceScatter), 12);
  EXPECT_EQ(comm->stats().BytesSent(CommOp::kReduceScatter), 0);
}

TEST(NcclCommunicatorTest, AllReduceSumAvgDivideMaxMin) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  for (at::ScalarType dtype : kDtypes) {
    const int64_t n = 17;
    const at::Tensor x = Pattern(n, dtype);
    struct Case {
      ReduceOp op;
      double pre, post, divisor;
    };
    for (const Case& c : std::vector<Case>{{ReduceOp::kSum, 1, 1, 1},
                                           {ReduceOp::kAvg, 1, 1, 1},
                                           {ReduceOp::kSum, 2, 4, 8},
                                           {ReduceOp::kAvg, 4, 2, 8},
                                           {ReduceOp::kMax, 1, 1, 1},
                                           {ReduceOp::kMin, 1, 1, 1}}) {
      at::Tensor t = x.clone();
      ReduceOptions o;
      o.op = c.op;
      o.pre_divide = c.pre;
      o.post_divide = c.post;
      comm->AllReduce(t, o)->Wait();
      EXPECT_TRUE(Same(t, x.to(at::kDouble) / c.divisor))
          << dtype << " " << ReduceOpName(c.op) << " pre " << c.pre << " post " << c.post << ": " << t;
    }
  }
  EXPECT_EQ(comm->stats().BytesSent(CommOp::kAllReduce), 0);
}

TEST(NcclCommunicatorTest, BroadcastFromRootZero) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  for (at::ScalarType dtype : kDtypes) {
    at::Tensor t = Pattern(9, dtype);
    const at::Tensor expected = t.clone();
    comm->Broadcast(t, 0)->Wait();
    EXPECT_TRUE(Same(t, expected)) << dtype;
  }
  EXPECT_EQ(comm->stats().Calls(CommOp::kBroadcast), 2);
}

TEST(NcclCommunicatorTest, BarrierBlocksUntilDone) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  auto work = comm->Barrier();
  work->Wait();
  EXPECT_TRUE(work->IsCompleted());
  comm->Barrier()->Wait(std::chrono::milliseconds(10000));
  EXPECT_EQ(comm->stats().Calls(CommOp::kBarrier), 2);
}

TEST(NcclCommunicatorTest, EveryDtype) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  for (at::ScalarType dtype :
       {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kLong, at::kByte, at::kChar}) {
    const at::Tensor x = Pattern(5, dtype);
    at::Tensor full = at::zeros({5}, Cuda(dtype));
    comm->AllGather(x, full)->Wait();
    EXPECT_TRUE(Same(full, x)) << dtype;
    at::Tensor t = x.clone();
    comm->AllReduce(t, {})->Wait();
    EXPECT_TRUE(Same(t, x)) << dtype;
    ReduceOptions avg;
    avg.op = ReduceOp::kAvg;
    at::Tensor shard = at::zeros({5}, Cuda(dtype));
    comm->ReduceScatter(x, shard, avg)->Wait();
    EXPECT_TRUE(Same(shard, x)) << dtype;
  }
}

// The collective runs on the communicator's stream, ordered by events with
// the caller's (non-default) current stream in both directions.
TEST(NcclCommunicatorTest, OrderedWithTheCurrentStream) {
  REQUIRE_GPU();
  for (bool blocking : {false, true}) {
    NcclOptions o;
    o.blocking_wait = blocking;
    auto comm = MakeWorld(o);
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
    c10::cuda::CUDAStreamGuard guard(side);
    const int64_t n = int64_t{1} << 24;
    at::Tensor t = at::zeros({n}, Cuda(at::kFloat));
    for (int i = 0; i < 20; ++i) t.add_(1);  // queued on `side`, long enough to race with a careless comm stream
    ReduceOptions post;
    post.post_divide = 4;
    auto work = comm->AllReduce(t, post);
    work->Wait();
    at::Tensor after = t * 2;  // on `side`, after Wait ordered it behind the collective
    EXPECT_TRUE(at::equal(after.cpu(), at::full({n}, 10.0f))) << "blocking_wait=" << blocking;
    if (blocking) {
      EXPECT_TRUE(work->IsCompleted());
    }
    side.synchronize();
    EXPECT_TRUE(work->IsCompleted());
  }
}

// Tensors dropped right after the call stay valid for the collective
// (recordStream on the communicator's stream).
TEST(NcclCommunicatorTest, DroppedTensorsAreNotReusedEarly) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  std::vector<WorkPtr> works;
  at::Tensor keep = at::zeros({1 << 20}, Cuda(at::kFloat));
  for (int i = 0; i < 8; ++i) {
    at::Tensor in = at::full({1 << 20}, static_cast<float>(i + 1), Cuda(at::kFloat));
    works.push_back(comm->AllGather(in, keep));
  }
  for (auto& w : works) w->Wait();
  EXPECT_TRUE(at::equal(keep.cpu(), at::full({1 << 20}, 8.0f)));
}

// A tensor that took part in a collective (a model's parameter) may be freed
// after its communicator is gone: the caching allocator then records an
// event on the communicator's stream, which must still exist (it crashed
// with a stream of the communicator's own, destroyed with it).
TEST(NcclCommunicatorTest, TensorsOutliveTheirCommunicator) {
  REQUIRE_GPU();
  at::Tensor shard = Pattern(1 << 16, at::kFloat);
  at::Tensor full = at::zeros({1 << 16}, Cuda(at::kFloat));
  {
    auto comm = MakeWorld();
    comm->AllGather(shard, full)->Wait();
  }
  EXPECT_TRUE(Same(full, shard));
  shard = at::Tensor();
  full = at::Tensor();  // frees blocks recordStream'ed on the communicator's stream
  EXPECT_TRUE(Same(at::ones({4}, Cuda(at::kFloat)).sum(), at::full({}, 4.0)));
}

TEST(NcclCommunicatorTest, SubGroupsOfAWorldOfOne) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  auto sub = comm->NewGroup({0}, "sub");
  ASSERT_TRUE(sub != nullptr);
  EXPECT_EQ(sub->name(), std::string("world/sub"));
  EXPECT_EQ(sub->size(), 1);
  at::Tensor t = Pattern(7, at::kBFloat16);
  const at::Tensor expected = t.clone();
  sub->AllReduce(t, {})->Wait();
  EXPECT_TRUE(Same(t, expected));
  HybridGroups groups = comm->SplitHybrid(1);
  ASSERT_TRUE(groups.shard != nullptr && groups.replicate != nullptr);
  groups.shard->Barrier()->Wait();
  groups.replicate->Barrier()->Wait();
}

TEST(NcclCommunicatorTest, BadInputsAreClearErrors) {
  REQUIRE_GPU();
  auto comm = MakeWorld();
  const at::Tensor x = Pattern(8, at::kFloat);
  at::Tensor full = at::zeros({8}, Cuda(at::kFloat));
  EXPECT_THROW(comm->AllGather(x.cpu(), full.cpu()), InvalidArgumentError);
  EXPECT_THROW(comm->AllGather(x, at::zeros({9}, Cuda(at::kFloat))), InvalidArgumentError);
  EXPECT_THROW(comm->AllGather(x, at::zeros({8}, Cuda(at::kBFloat16))), InvalidArgumentError);
  EXPECT_THROW(comm->ReduceScatter(x, at::zeros({7}, Cuda(at::kFloat)), {}), InvalidArgumentError);
  EXPECT_THROW(comm->AllReduce(at::zeros({4}, Cuda(at::kBool)), {}), InvalidArgumentError);
  EXPECT_THROW(comm->AllReduce(at::zeros({4, 4}, Cuda(at::kFloat)).t(), {}), InvalidArgumentError);
  EXPECT_THROW(comm->Broadcast(full, 1), InvalidArgumentError);
  ReduceOptions int_divide;
  int_divide.pre_divide = 2;
  EXPECT_THROW(comm->AllReduce(at::zeros({4}, Cuda(at::kInt)), int_divide), InvalidArgumentError);
  ReduceOptions max_divide;
  max_divide.op = ReduceOp::kMax;
  max_divide.post_divide = 2;
  EXPECT_THROW(comm->AllReduce(full, max_divide), InvalidArgumentError);
  ReduceOptions zero;
  zero.pre_divide = 0;
  EXPECT_THROW(comm->AllReduce(full, zero), InvalidArgumentError);
  EXPECT_THROW(NcclCommunicator::Create(nullptr, 0, 1), InvalidArgumentError);
  NcclOptions bad_stall;  // the stall watch's own logic is tested on the CPU (peer_watch_test)
  bad_stall.stall_warning = std::chrono::milliseconds(-1);
  EXPECT_THROW(MakeWorld(bad_stall), InvalidArgumentError);
  // Still healthy after rejected calls.
  comm->AllReduce(full, {})->Wait();
}

// A group that never forms fails within the timeout, naming the group.
TEST(NcclCommunicatorTest, MissingPeersTimeOut) {
  REQUIRE_GPU();
  NcclOptions o;
  o.name = "lonely";
  o.timeout = std::chrono::milliseconds(3000);
  // Rank 1 waits for rank 0's ncclUniqueId that never comes.
  try {
    NcclCommunicator::Create(c10::make_intrusive<c10d::HashStore>(), 1, 2, o);
    EXPECT_TRUE(false) << "rank 1 without rank 0 must time out";
  } catch (const CommTimeoutError& e) {
    EXPECT_TRUE(std::string(e.what()).find("'lonely'") != std::string::npos) << e.what();
  }
  // Rank 0 starts NCCL's bootstrap; rank 1 never joins: ncclCommAbort after the timeout.
  const auto start = std::chrono::steady_clock::now();
  try {
    NcclCommunicator::Create(c10::make_intrusive<c10d::HashStore>(), 0, 2, o);
    EXPECT_TRUE(false) << "rank 0 without rank 1 must time out";
  } catch (const CommTimeoutError& e) {
    EXPECT_TRUE(std::string(e.what()).find("'lonely'") != std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
}

// A collective stuck behind GPU work (a spin kernel queued on the caller's
// stream, which the collective is ordered after; as a peer that never comes
// leaves NCCL's kernel spinning) is bounded by the communicator's timeout:
// Wait throws CommTimeoutError within timeout + 2 s naming the collective,
// its number, the group, the timeout and how to change it; the communicator
// is aborted and the next call fails at once. The spin ends by itself (~6 s).
TEST(NcclCommunicatorTest, StuckCollectiveTimesOutAndLaterCallsFailAtOnce) {
  REQUIRE_GPU();
  using Ms = std::chrono::milliseconds;
  using SteadyClock = std::chrono::steady_clock;
  auto ms_since = [](SteadyClock::time_point t) {
    return std::chrono::duration_cast<Ms>(SteadyClock::now() - t).count();
  };
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  c10::cuda::CUDAStreamGuard guard(side);
  // Calibrate at::cuda::sleep (it counts SM clock cycles).
  at::cuda::sleep(1000);
  side.synchronize();
  const int64_t probe = 200'000'000;
  auto t0 = SteadyClock::now();
  at::cuda::sleep(probe);
  side.synchronize();
  const double cycles_per_ms = static_cast<double>(probe) / static_cast<double>(std::max<int64_t>(ms_since(t0), 1));

  NcclOptions o;
  o.name = "stuck";
  o.timeout = Ms(2000);
  o.blocking_wait = true;
  auto comm = MakeWorld(o);
  at::Tensor t = at::ones({1024}, Cuda(at::kFloat));
  comm->AllReduce(t, {})->Wait();  // collective #1 completes
  side.synchronize();
  at::cuda::sleep(static_cast<int64_t>(cycles_per_ms * 6000));  // ~6 s of spin ahead of collective #2
  const auto start = SteadyClock::now();
  try {
    comm->AllReduce(t, {})->Wait();
    EXPECT_TRUE(false) << "a collective behind 6 s of GPU work must time out after 2 s";
  } catch (const CommTimeoutError& e) {
    const std::string what = e.what();
    for (const char* part : {"AllReduce on nccl group 'stuck'", "collective #2 of this rank", "timed out after 2000 ms",
                             "NcclOptions::timeout", "TrainerOptions::timeout", "--timeout_s", "aborted"}) {
      EXPECT_TRUE(what.find(part) != std::string::npos) << "missing '" << part << "' in: " << what;
    }
  }
  const int64_t waited = ms_since(start);
  EXPECT_TRUE(waited >= 1900 && waited <= 4000) << "Wait threw after " << waited << " ms (timeout 2000 ms)";
  // The communicator is unusable: the next call fails at once, with the reason.
  const auto again = SteadyClock::now();
  try {
    comm->AllReduce(t, {});
    EXPECT_TRUE(false) << "a call on a timed-out communicator must fail";
  } catch (const CommTimeoutError& e) {
    EXPECT_TRUE(std::string(e.what()).find("called on a failed communicator") != std::string::npos) << e.what();
  }
  EXPECT_TRUE(ms_since(again) < 200) << "the call after the timeout took " << ms_since(again) << " ms";
  // The spin ends by itself: later tests get an idle GPU (bounded, so a
  // collective that never completes after the abort fails here, not hangs).
  const auto spin = SteadyClock::now();
  cudaError_t q = cudaErrorNotReady;
  while ((q = cudaStreamQuery(side.stream())) == cudaErrorNotReady && ms_since(spin) < 30000) {
    std::this_thread::sleep_for(Ms(10));
  }
  EXPECT_TRUE(q == cudaSuccess) << "the stream did not drain within 30 s after the abort: " << cudaGetErrorName(q);
  std::fprintf(stderr, "  stuck collective: timed out after %lld ms (calibrated %.0f cycles/ms)\n",
               static_cast<long long>(waited), cycles_per_ms);
}

}  // namespace
}  // namespace shardtrain::comm
