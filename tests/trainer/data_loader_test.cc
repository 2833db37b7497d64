// trainer/data/data_loader.h alone (no Trainer): the same batches in the same
// order at any num_workers, prefetching that overlaps with the consumer,
// bounded look-ahead, errors naming the batch, clean destruction mid-pass,
// option checks, pinned batches; and Batch's named fields.
#include "trainer/data/data_loader.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "base/errors.h"
#include "trainer/data/data.h"

namespace shardtrain::trainer {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// Three tensors per sample (inputs, targets and a "mask" field).
TensorDataset ThreeTensorData(int64_t n) {
  auto g = at::detail::createCPUGenerator(11);
  at::Tensor x = at::randn({n, 5}, g);
  return TensorDataset(x, at::arange(n, at::kLong), {{"mask", x.gt(0)}});
}

std::vector<std::vector<int64_t>> ShuffledBatches(int64_t n, int64_t batch) {
  DistributedSampler sampler(n, 2, 1, /*shuffle=*/true, 9, false);
  sampler.set_epoch(3);
  return MakeBatches(sampler.indices(), batch, false);
}

// Takes 0-3 ms per batch depending on its first sample, so that workers
// finish batches out of order.
class JitteredDataset : public Dataset {
 public:
  explicit JitteredDataset(const Dataset& data) : data_(data) {}
  int64_t size() const override { return data_.size(); }
  Batch get_batch(const std::vector<int64_t>& indices) const override {
    std::this_thread::sleep_for(std::chrono::milliseconds((indices.front() * 7) % 4));
    return data_.get_batch(indices);
  }

 private:
  const Dataset& data_;
};

std::vector<Batch> ReadAll(const Dataset& data, const std::vector<std::vector<int64_t>>& batches, int workers,
                           int prefetch = 2) {
  DataLoader loader(data, batches, {workers, prefetch});
  std::vector<Batch> out;
  while (loader.has_next()) out.push_back(loader.Next());
  return out;
}

TEST(DataLoader, SameBatchesInSameOrderAtAnyNumWorkers) {
  TensorDataset data = ThreeTensorData(101);
  const auto batches = ShuffledBatches(101, 4);  // 51 samples on rank 1: 12 batches of 4 and one of 3
  const std::vector<Batch> inline_batches = ReadAll(data, batches, 0);
  ASSERT_EQ(inline_batches.size(), batches.size());
  for (size_t k = 0; k < batches.size(); ++k) {  // num_workers=0 is get_batch itself
    Batch want = data.get_batch(batches[k]);
    ASSERT_TRUE(inline_batches[k].inputs.equal(want.inputs));
  }
  for (int workers : {1, 4}) {
    for (int prefetch : {1, 2, 5}) {
      SCOPED_TRACE("num_workers " + std::to_string(workers) + " prefetch_factor " + std::to_string(prefetch));
      const std::vector<Batch> got = ReadAll(JitteredDataset(data), batches, workers, prefetch);
      ASSERT_EQ(got.size(), inline_batches.size());
      for (size_t k = 0; k < got.size(); ++k) {
        EXPECT_TRUE(got[k].inputs.equal(inline_batches[k].inputs)) << "batch " << k;
        EXPECT_TRUE(got[k].targets.equal(inline_batches[k].targets)) << "batch " << k;
        EXPECT_TRUE(got[k].get("mask").equal(inline_batches[k].get("mask"))) << "batch " << k;
      }
    }
  }
}

// Serves positions [begin, end) only (a resumed epoch, a limited pass).
TEST(DataLoader, ServesTheRequestedRange) {
  TensorDataset data = ThreeTensorData(40);
  const auto batches = MakeBatches(
      [] {
        std::vector<int64_t> v(40);
        for (int64_t i = 0; i < 40; ++i) v[i] = i;
        return v;
      }(),
      4, false);
  for (int workers : {0, 3}) {
    DataLoader loader(data, batches, {workers, 2}, 3, 7);
    std::vector<int64_t> firsts;
    while (loader.has_next()) firsts.push_back(loader.Next().targets[0].item<int64_t>());
    EXPECT_EQ(firsts, (std::vector<int64_t>{12, 16, 20, 24}));
    EXPECT_THROW(loader.Next(), InvalidArgumentError);
  }
  EXPECT_THROW(DataLoader(data, batches, {}, 5, 4), InvalidArgumentError);
  EXPECT_THROW(DataLoader(data, batches, {}, 0, 11), InvalidArgumentError);
}

// Each get_batch sleeps; counts calls and the most running at once.
class SlowDataset : public Dataset {
 public:
  explicit SlowDataset(std::chrono::milliseconds delay, int64_t throw_at = -1) : delay_(delay), throw_at_(throw_at) {}
  int64_t size() const override { return 1000; }
  Batch get_batch(const std::vector<int64_t>& indices) const override {
    const int now = ++running_;
    int seen = max_running_.load();
    while (now > seen && !max_running_.compare_exchange_weak(seen, now)) {
    }
    ++calls_;
    std::this_thread::sleep_for(delay_);
    --running_;
    if (indices.front() == throw_at_) throw std::runtime_error("corrupt record " + std::to_string(throw_at_));
    return {at::tensor(indices, at::kLong), at::Tensor()};
  }
  int calls() const { return calls_; }
  int max_running() const { return max_running_; }

 private:
  std::chrono::milliseconds delay_;
  int64_t throw_at_;
  mutable std::atomic<int> running_{0}, max_running_{0}, calls_{0};
};

std::vector<std::vector<int64_t>> OnePerBatch(int64_t n) {
  std::vector<std::vector<int64_t>> b;
  for (int64_t i = 0; i < n; ++i) b.push_back({i});
  return b;
}

// Loading and the consumer's work (both 40 ms per batch, 10 batches) overlap
// with workers: the pass takes about max(load, work) = 0.4 s, not their sum
// 0.8 s. Inline it takes the sum.
TEST(DataLoader, PrefetchingOverlapsLoadingWithTheStep) {
  const auto delay = std::chrono::milliseconds(40);
  const int n = 10;
  auto pass = [&](int workers) {
    SlowDataset data(delay);
    const auto t0 = Clock::now();
    DataLoader loader(data, OnePerBatch(n), {workers, 2});
    while (loader.has_next()) {
      loader.Next();
      std::this_thread::sleep_for(delay);  // the "training step"
    }
    return Seconds(t0);
  };
  const double inline_s = pass(0), one_worker_s = pass(1), two_workers_s = pass(2);
  const double sum = 2 * n * 0.040, max = n * 0.040;
  EXPECT_GE(inline_s, sum * 0.95);
  // max plus one batch's load (the first is not hidden) plus scheduling slack.
  EXPECT_LT(one_worker_s, max + 0.040 + 0.15) << "inline " << inline_s;
  EXPECT_LT(two_workers_s, max + 0.040 + 0.15) << "inline " << inline_s;
}

// Waits (up to 5 s, for a loaded machine) until `data` saw `n` get_batch calls.
void WaitForCalls(const SlowDataset& data, int n) {
  const auto t0 = Clock::now();
  while (data.calls() < n && Seconds(t0) < 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

// At most num_workers * prefetch_factor batches are loaded ahead of the consumer.
TEST(DataLoader, LookAheadIsBounded) {
  SlowDataset data(std::chrono::milliseconds(1));
  DataLoader loader(data, OnePerBatch(50), {3, 2});
  WaitForCalls(data, 6);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // room for more, were there no bound
  EXPECT_EQ(data.calls(), 6);
  loader.Next();
  WaitForCalls(data, 7);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(data.calls(), 7);
  EXPECT_LE(data.max_running(), 3);
}

TEST(DataLoader, GetBatchErrorNamesTheBatch) {
  for (int workers : {0, 2}) {
    SCOPED_TRACE("num_workers " + std::to_string(workers));
    SlowDataset data(std::chrono::milliseconds(1), /*throw_at=*/5);
    DataLoader loader(data, OnePerBatch(10), {workers, 2});
    for (int k = 0; k < 5; ++k) EXPECT_EQ(loader.Next().inputs.item<int64_t>(), k);  // before it: fine
    try {
      loader.Next();
      FAIL() << "batch 5 should have failed";
    } catch (const DataLoaderError& e) {
      EXPECT_EQ(e.batch_index(), 5);
      EXPECT_NE(std::string(e.what()).find("get_batch failed for batch 5 of 10 (samples 5)"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("corrupt record 5"), std::string::npos) << e.what();
      EXPECT_THROW(std::rethrow_exception(e.cause()), std::runtime_error);
    }
  }
}

// Destroying a loader whose workers are blocked on a full queue, or are
// inside a slow get_batch, returns promptly (joins; no hang, no leak).
TEST(DataLoader, DestroyMidPassDoesNotHang) {
  for (int workers : {1, 4}) {
    SCOPED_TRACE("num_workers " + std::to_string(workers));
    {
      SlowDataset fast(std::chrono::milliseconds(0));
      const auto t0 = Clock::now();
      {
        DataLoader loader(fast, OnePerBatch(1000), {workers, 2});
        loader.Next();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // queue full, workers waiting
      }
      EXPECT_LT(Seconds(t0), 1.0);
    }
    SlowDataset slow(std::chrono::milliseconds(300));
    const auto t0 = Clock::now();
    {
      DataLoader loader(slow, OnePerBatch(1000), {workers, 4});
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // every worker inside get_batch
    }
    EXPECT_LT(Seconds(t0), 1.0);
    EXPECT_EQ(slow.calls(), workers);  // each finished the batch it was in, took no other
  }
}

TEST(DataLoader, OptionsAreRangeChecked) {
  TensorDataset data = ThreeTensorData(8);
  const auto batches = ShuffledBatches(8, 2);
  try {
    DataLoader(data, batches, {-1, 2});
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("num_workers must be in [0, 256]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("got -1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(CheckDataLoaderOptions({kMaxDataLoaderWorkers + 1, 2}), InvalidArgumentError);
  try {
    CheckDataLoaderOptions({2, 0});
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("prefetch_factor"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("must be in [1, 1024], got 0"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(CheckDataLoaderOptions({0, 2}));
}

// pin_memory pins every tensor of every batch where it is prepared (so the
// Trainer's copies to a CUDA device are asynchronous); without CUDA it is
// refused, naming the option and the valid value.
TEST(DataLoader, PinMemoryPinsBatchesOrNeedsCuda) {
  TensorDataset data = ThreeTensorData(8);
  DataLoaderOptions o;
  o.num_workers = 1;
  o.pin_memory = true;
  if (!at::globalContext().hasCUDA()) {
    try {
      DataLoader(data, ShuffledBatches(8, 2), o);
      FAIL() << "pin_memory without CUDA was accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("pin_memory"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("valid: pin_memory = false"), std::string::npos) << e.what();
    }
    return;
  }
  for (int workers : {0, 1}) {
    o.num_workers = workers;
    DataLoader loader(data, ShuffledBatches(8, 2), o);
    Batch b = loader.Next();
    EXPECT_TRUE(b.inputs.is_pinned());
    EXPECT_TRUE(b.targets.is_pinned());
    EXPECT_TRUE(b.get("mask").is_pinned());
  }
}

TEST(Batch, NamedFields) {
  Batch b{at::ones({2}), at::zeros({2})};
  b.set("mask", at::ones({2}, at::kBool));
  EXPECT_TRUE(b.has("mask"));
  EXPECT_TRUE(b.get("inputs").equal(at::ones({2})));
  EXPECT_EQ(b.names(), (std::vector<std::string>{"inputs", "targets", "mask"}));
  try {
    b.get("weights");
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'weights'; it has: inputs, targets, mask"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(TensorDataset(at::ones({3, 2}), at::ones({3}), {{"mask", at::ones({4})}}), InvalidArgumentError);
  EXPECT_THROW(TensorDataset(at::ones({3, 2}), at::ones({3}), {{"targets", at::ones({3})}}), InvalidArgumentError);
}

}  // namespace
}  // namespace shardtrain::trainer
