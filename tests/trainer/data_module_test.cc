// The Trainer's data side with real ranks (threads over Gloo): DataModule
// (prepare_data once per node before any setup, setup/teardown with the
// stage on every rank, Fit through it equal to Fit on the data sets), the
// background loader in Fit (identical losses at any num_workers, also
// resumed mid-epoch; errors name the batch; options checked) and batches
// with a third tensor through Fit.
#include "trainer/data_module.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "base/errors.h"
#include "tests/testing/multi_rank.h"
#include "tests/trainer/fixtures.h"
#include "trainer/data/data.h"
#include "trainer/data/data_loader.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace {
using fixtures::BaseOptions;
using fixtures::Classifier;
using fixtures::MakeData;
using fixtures::TmpDir;
using shardtrain::testing::RunRanks;

// Records what the Trainer calls; prepare_data is slow (so a rank that did not
// wait for it would run setup too early) and counts itself in `prepared`.
class RecordingData : public DataModule {
 public:
  RecordingData(std::atomic<int>* prepared, bool fail = false) : prepared_(prepared), fail_(fail) {}
  void prepare_data() override {
    ++prepare_calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (fail_) throw std::runtime_error("disk full while unpacking");
    ++*prepared_;
  }
  void setup(Stage stage) override {
    stages.push_back(stage);
    prepared_at_setup.push_back(prepared_->load());
    if (stage == Stage::kFit) train_ = MakeData(64, 1);
    val_ = MakeData(16, 2);
  }
  void teardown(Stage stage) override { teardowns.push_back(stage); }
  const Dataset* train_dataset() override { return train_.get(); }
  const Dataset* val_dataset() override { return val_.get(); }

  int prepare_calls = 0;
  std::vector<Stage> stages, teardowns;
  std::vector<int> prepared_at_setup;

 private:
  std::atomic<int>* prepared_;
  bool fail_;
  std::shared_ptr<TensorDataset> train_, val_;
};

TEST(DataModule, PrepareOncePerNodeThenSetupWithTheStageOnEveryRank) {
  // 1 node of 2 ranks: prepare_data on rank 0 only. 2 nodes of 1 rank: on
  // both (per node), or on rank 0 only with prepare_data_per_node = false.
  struct Case {
    int devices, num_nodes;
    bool per_node;
    std::vector<int> expect_prepare;
  };
  for (const Case& c : {Case{2, 1, true, {1, 0}}, Case{1, 2, true, {1, 1}}, Case{1, 2, false, {1, 0}}}) {
    SCOPED_TRACE("devices " + std::to_string(c.devices) + " num_nodes " + std::to_string(c.num_nodes));
    TrainerOptions o = BaseOptions(TmpDir("dm_stages"), 2);
    o.max_epochs = 1;
    o.devices = c.devices;
    o.num_nodes = c.num_nodes;
    std::atomic<int> prepared{0};
    std::vector<std::unique_ptr<RecordingData>> data;
    for (int r = 0; r < 2; ++r) data.push_back(std::make_unique<RecordingData>(&prepared));
    RunRanks(2, [&](int rank, const auto& comm) {
      Classifier module;
      Trainer trainer(o, comm);
      data[rank]->prepare_data_per_node = c.per_node;
      trainer.Fit(module, *data[rank]);
      trainer.Validate(module, *data[rank]);
    });
    const int total = c.expect_prepare[0] + c.expect_prepare[1];
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_EQ(data[r]->prepare_calls, 2 * c.expect_prepare[r]);  // once per Fit and per Validate
      EXPECT_EQ(data[r]->stages, (std::vector<Stage>{Stage::kFit, Stage::kValidate}));
      EXPECT_EQ(data[r]->teardowns, (std::vector<Stage>{Stage::kFit, Stage::kValidate}));
      // Every rank's setup ran after every prepare_data of that call had finished.
      EXPECT_EQ(data[r]->prepared_at_setup, (std::vector<int>{total, 2 * total}));
    }
  }
  EXPECT_STREQ(StageName(Stage::kPredict), "predict");
}

TEST(DataModule, PrepareDataFailureThrowsOnEveryRank) {
  TrainerOptions o = BaseOptions(TmpDir("dm_fail"), 2);
  std::atomic<int> prepared{0};
  std::vector<std::string> errors(2);
  std::vector<std::unique_ptr<RecordingData>> data;
  for (int r = 0; r < 2; ++r) data.push_back(std::make_unique<RecordingData>(&prepared, /*fail=*/true));
  RunRanks(2, [&](int rank, const auto& comm) {
    Classifier module;
    Trainer trainer(o, comm);
    try {
      trainer.Fit(module, *data[rank]);
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_EQ(errors[0], "disk full while unpacking");
  EXPECT_NE(errors[1].find("prepare_data failed on 1 other rank(s)"), std::string::npos) << errors[1];
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(data[r]->stages.empty());  // no setup after a failed prepare_data
}

TEST(DataModule, MissingDatasetNamesTheAccessor) {
  class Empty : public DataModule {};
  Empty empty;
  Classifier module;
  TrainerOptions o = BaseOptions(TmpDir("dm_empty"), 1);
  Trainer trainer(o);
  try {
    trainer.Fit(module, empty);
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("train_dataset() returned null after setup(fit)"), std::string::npos)
        << e.what();
  }
}

TEST(DataModule, FitThroughTheDataModuleEqualsFitOnTheDatasets) {
  TrainerOptions o = BaseOptions(TmpDir("dm_equal_a"), 2);
  o.strategy = "fsdp_native";
  const fixtures::FitResult direct = fixtures::Fit(2, o);
  ASSERT_EQ(direct.losses.size(), 12u);
  o.default_root_dir = TmpDir("dm_equal_b");
  std::atomic<int> prepared{0};
  std::vector<double> losses, val_losses;
  RunRanks(2, [&](int rank, const auto& comm) {
    RecordingData data(&prepared);
    Classifier module;
    Trainer trainer(o, comm);
    trainer.Fit(module, data);
    if (rank == 0) {
      losses = trainer.step_losses();
      val_losses = trainer.val_losses();
    }
  });
  EXPECT_EQ(losses, direct.losses);  // bit for bit
  EXPECT_EQ(val_losses, direct.val_losses);
}

// The background loader changes when batches are made, not which: the same
// losses at any num_workers, also when resuming in the middle of an epoch.
TEST(DataLoaderInFit, SameLossesAtAnyNumWorkers) {
  TrainerOptions o = BaseOptions(TmpDir("nw_0"), 2);
  o.strategy = "fsdp_native";
  o.accumulate_grad_batches = 2;
  o.batch_size = 4;
  const fixtures::FitResult base = fixtures::Fit(2, o);
  ASSERT_EQ(base.losses.size(), 12u);
  for (int workers : {1, 4}) {
    SCOPED_TRACE("num_workers " + std::to_string(workers));
    TrainerOptions w = o;
    w.num_workers = workers;
    w.prefetch_factor = workers == 1 ? 1 : 3;
    w.default_root_dir = TmpDir("nw_" + std::to_string(workers));
    const fixtures::FitResult r = fixtures::Fit(2, w);
    EXPECT_EQ(r.losses, base.losses);
    EXPECT_EQ(r.val_losses, base.val_losses);
    // Stop after 5 steps (mid-epoch 1), resume with the loader: the rest is the same.
    w.default_root_dir = TmpDir("nw_resume_" + std::to_string(workers));
    w.max_steps = 5;
    const fixtures::FitResult first = fixtures::Fit(2, w);
    w.max_steps = -1;
    const fixtures::FitResult second = fixtures::Fit(2, w, first.last_ckpt);
    std::vector<double> joined = first.losses;
    joined.insert(joined.end(), second.losses.begin(), second.losses.end());
    EXPECT_EQ(joined, base.losses);
  }
}

// get_batch fails for the batch that starts at sample 32 (unshuffled, W=1,
// batch 16: the third batch).
class FailingData : public Dataset {
 public:
  int64_t size() const override { return data_->size(); }
  Batch get_batch(const std::vector<int64_t>& indices) const override {
    if (indices.front() == 32) throw std::runtime_error("unreadable shard");
    return data_->get_batch(indices);
  }

 private:
  std::shared_ptr<TensorDataset> data_ = MakeData(64, 1);
};

TEST(DataLoaderInFit, DatasetErrorNamesTheBatch) {
  for (int workers : {0, 2}) {
    SCOPED_TRACE("num_workers " + std::to_string(workers));
    TrainerOptions o = BaseOptions(TmpDir("nw_error"), 1);
    o.num_workers = workers;
    o.shuffle = false;
    FailingData data;
    Classifier module;
    Trainer trainer(o);
    try {
      trainer.Fit(module, data);
      FAIL();
    } catch (const DataLoaderError& e) {
      EXPECT_EQ(e.batch_index(), 2);
      EXPECT_NE(std::string(e.what()).find("get_batch failed for batch 2 of 4 (samples 32, 33, 34, 35, ... 16 in all)"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("unreadable shard"), std::string::npos) << e.what();
    }
    EXPECT_EQ(trainer.global_step(), 2);  // the batches before it trained
  }
}

TEST(DataLoaderInFit, OptionsAreChecked) {
  TrainerOptions o;
  o.num_workers = -2;
  try {
    Trainer t(o);
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("num_workers must be in [0, 256]"), std::string::npos) << e.what();
  }
  o.num_workers = 2;
  o.prefetch_factor = 0;
  EXPECT_THROW(Trainer t(o), InvalidArgumentError);
}

// A data set whose batches carry inputs, targets and a "mask" (which rows
// count in the loss). The module checks the mask belongs to the batch's rows
// (it is a function of the inputs) and uses it.
class MaskedClassifier : public Classifier {
 public:
  at::Tensor training_step(const Batch& b, int64_t) override {
    const at::Tensor& mask = b.get("mask");
    if (!mask.equal(b.inputs.select(1, 4).gt(0))) throw std::logic_error("mask does not match the batch's rows");
    seen_masked += static_cast<int64_t>((~mask).sum().item<int64_t>());
    at::Tensor out = forward([&] { return net_->forward(b.inputs); });
    at::Tensor per_row = at::cross_entropy_loss(out.to(at::kFloat), b.targets, {}, at::Reduction::None);
    return (per_row * mask.to(at::kFloat)).sum() / mask.sum().clamp_min(1);
  }
  int64_t seen_masked = 0;
};

TEST(Batch, ThreeTensorsThroughFit) {
  auto g = at::detail::createCPUGenerator(5);
  at::Tensor x = at::randn({64, 8}, g);
  TensorDataset data(x, x.slice(1, 0, 3).argmax(1), {{"mask", x.select(1, 4).gt(0)}});
  TrainerOptions o = BaseOptions(TmpDir("three_tensors"), 2);
  o.strategy = "fsdp_native";
  o.num_workers = 2;
  std::vector<double> losses;
  std::vector<int64_t> masked(2);
  RunRanks(2, [&](int rank, const auto& comm) {
    MaskedClassifier module;
    Trainer trainer(o, comm);
    trainer.Fit(module, data);
    masked[rank] = module.seen_masked;
    if (rank == 0) losses = trainer.step_losses();
  });
  ASSERT_EQ(losses.size(), 12u);
  EXPECT_LT(losses.back(), losses.front() * 0.9);
  EXPECT_GT(masked[0] + masked[1], 0);  // some rows were masked out
}

}  // namespace
}  // namespace shardtrain::trainer
