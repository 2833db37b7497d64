// Run controls (trainer/loops/run_controls.h, trainer/callbacks/model_summary.h) through
// real Fits with threads-as-ranks over Gloo: what each control makes run,
// counted per rank (training_step and validation_step calls, the batches
// they saw), logged rows and files written.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "base/errors.h"
#include "tests/trainer/fixtures.h"
#include "trainer/callbacks/callback.h"
#include "trainer/callbacks/early_stopping.h"
#include "trainer/callbacks/learning_rate_monitor.h"
#include "trainer/callbacks/model_checkpoint.h"
#include "trainer/callbacks/model_summary.h"
#include "trainer/loops/run_controls.h"

namespace shardtrain::trainer {
namespace {
namespace fs = std::filesystem;
using fixtures::BaseOptions;
using fixtures::Classifier;
using fixtures::ClassifierConfig;
using fixtures::MakeData;
using fixtures::TmpDir;

// Counts its steps and records the first input feature of every batch it saw.
class Counting : public Classifier {
 public:
  using Classifier::Classifier;
  at::Tensor training_step(const Batch& b, int64_t i) override {
    train_first.push_back(b.inputs[0][0].item<double>());
    return Classifier::training_step(b, i);
  }
  std::optional<at::Tensor> validation_step(const Batch& b, int64_t i) override {
    ++val_steps;
    if (trainer().sanity_checking()) ++sanity_steps;
    log("val_probe", 1.0);
    val_first.push_back(b.inputs[0][0].item<double>());
    if (!scripted_val.empty()) {
      (void)Classifier::validation_step(b, i);
      return at::full({}, scripted_val[std::min<size_t>(passes - 1, scripted_val.size() - 1)], at::kFloat);
    }
    return Classifier::validation_step(b, i);
  }
  void on_validation_start() override { ++passes; }
  std::vector<double> scripted_val;  // val_loss of validation pass k (the last repeats)
  std::vector<double> train_first, val_first;
  int64_t val_steps = 0, sanity_steps = 0;
  size_t passes = 0;
};

struct RankRun {
  int64_t train_steps = 0, val_steps = 0, sanity_steps = 0, global_step = 0, epoch = 0;
  std::vector<double> train_first, val_first, val_losses;
  std::string log_dir;
  TrainerOptions effective;
};

using Callbacks = std::function<std::vector<CallbackPtr>(int rank)>;

// Fits a Counting module on 64 training and 16 validation samples at `world`.
std::vector<RankRun> FitCounting(int world, const TrainerOptions& o, const Callbacks& callbacks = nullptr,
                         const std::vector<double>& scripted_val = {}) {
  auto train = MakeData(64, 1);
  auto val = MakeData(16, 2);
  std::vector<RankRun> runs(world);
  shardtrain::testing::RunRanks(world, [&](int rank, const auto& comm) {
    Counting module;
    module.scripted_val = scripted_val;
    TrainerOptions mine = o;
    if (callbacks) mine.callbacks = callbacks(rank);
    Trainer trainer(mine, comm);
    trainer.Fit(module, *train, val.get());
    RankRun& r = runs[rank];
    r.train_steps = static_cast<int64_t>(module.train_first.size());
    r.val_steps = module.val_steps;
    r.sanity_steps = module.sanity_steps;
    r.global_step = trainer.global_step();
    r.epoch = trainer.current_epoch();
    r.train_first = module.train_first;
    r.val_first = module.val_first;
    r.val_losses = trainer.val_losses();
    r.log_dir = trainer.log_dir();
    r.effective = trainer.options();
  });
  return runs;
}

int64_t CountFiles(const std::string& root) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(root)) n += e.is_regular_file() ? 1 : 0;
  return n;
}

// Steps of the metrics.csv rows with a value in `column`.
std::vector<int64_t> CsvSteps(const std::string& log_dir, const std::string& column) {
  std::ifstream in(fs::path(log_dir) / "metrics.csv");
  std::string line;
  std::getline(in, line);
  std::vector<std::string> header;
  std::stringstream hs(line);
  for (std::string h; std::getline(hs, h, ',');) header.push_back(h);
  const size_t step = std::find(header.begin(), header.end(), "step") - header.begin();
  const size_t col = std::find(header.begin(), header.end(), column) - header.begin();
  std::vector<int64_t> out;
  if (col == header.size()) return out;
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream ls(line);
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    cells.resize(header.size());
    if (!cells[col].empty()) out.push_back(std::stoll(cells[step]));
  }
  return out;
}

// 64 samples, 2 ranks, batch 8: 4 training batches per rank per epoch;
// validation batch 2: 4 validation batches per rank.
TrainerOptions Options(const std::string& root) {
  TrainerOptions o = BaseOptions(root, 2);
  o.strategy = "fsdp_native";
  o.val_batch_size = 2;
  o.enable_model_summary = false;
  return o;
}

TEST(RunControls, FastDevRunRunsNBatchesAndWritesNothing) {
  for (int64_t n : {2, 1}) {
    const std::string root = TmpDir("fast_dev_run_" + std::to_string(n));
    TrainerOptions o = Options(root);
    o.fast_dev_run = n == 1 ? true : n;  // true means 1, as Lightning's fast_dev_run=True
    o.loggers = {"csv", "tensorboard"};
    o.checkpoint_every_n_steps = 1;
    auto runs = FitCounting(2, o, [](int) -> std::vector<CallbackPtr> {
      ModelCheckpointOptions mc;
      mc.every_n_train_steps = 1;
      return {std::make_shared<ModelCheckpoint>(mc), std::make_shared<LearningRateMonitor>(),
              std::make_shared<EarlyStopping>()};
    });
    for (const auto& r : runs) {
      EXPECT_EQ(r.train_steps, n);
      EXPECT_EQ(r.val_steps, n);  // validation of n batches, no sanity steps
      EXPECT_EQ(r.sanity_steps, 0);
      EXPECT_EQ(r.global_step, n);
      EXPECT_EQ(r.val_losses.size(), 1u);
      EXPECT_EQ(r.effective.max_epochs.value_or(-7), 1);
      EXPECT_TRUE(r.effective.callbacks.empty());
      EXPECT_EQ(r.log_dir, "");
    }
    EXPECT_EQ(CountFiles(root), 0) << "fast_dev_run wrote logs or checkpoints";
  }
}

TEST(RunControls, SanityValStepsRunBeforeTrainingAndAreNotLogged) {
  struct Case {
    int64_t sanity;
    double limit_val;
    int64_t expect_sanity;
  };
  for (const Case& c : {Case{2, 1.0, 2}, Case{-1, 1.0, 4}, Case{0, 1.0, 0}, Case{3, 2, 2}}) {
    const std::string root = TmpDir("sanity");
    TrainerOptions o = Options(root);
    o.max_epochs = 1;
    o.num_sanity_val_steps = c.sanity;
    o.limit_val_batches = c.limit_val;
    const int64_t val_batches = c.limit_val > 1 ? static_cast<int64_t>(c.limit_val) : 4;
    auto runs = FitCounting(2, o);
    for (const auto& r : runs) {
      EXPECT_EQ(r.sanity_steps, c.expect_sanity) << "num_sanity_val_steps " << c.sanity;
      EXPECT_EQ(r.val_steps, c.expect_sanity + val_batches);
      EXPECT_EQ(r.train_steps, 4);
      EXPECT_EQ(r.val_losses.size(), 1u);
    }
    // Sanity steps come first: before any training batch the module saw only them.
    EXPECT_EQ(CsvSteps(runs[0].log_dir, "val_loss"), std::vector<int64_t>{4});
    EXPECT_EQ(CsvSteps(runs[0].log_dir, "val_probe"), std::vector<int64_t>{4});
  }
}

TEST(RunControls, CheckValEveryNEpoch) {
  const std::string root = TmpDir("every_n_epoch");
  TrainerOptions o = Options(root);
  o.max_epochs = 4;
  o.num_sanity_val_steps = 0;
  o.check_val_every_n_epoch = 2;
  auto runs = FitCounting(2, o);
  for (const auto& r : runs) EXPECT_EQ(r.val_steps, 2 * 4);  // epochs 1 and 3, 4 batches each
  EXPECT_EQ(CsvSteps(runs[0].log_dir, "val_loss"), (std::vector<int64_t>{8, 16}));
  // With val_check_interval 0.5: twice in each of those epochs.
  o.default_root_dir = TmpDir("every_n_epoch_half");
  o.val_check_interval = 0.5;
  runs = FitCounting(2, o);
  EXPECT_EQ(CsvSteps(runs[0].log_dir, "val_loss"), (std::vector<int64_t>{6, 8, 14, 16}));
}

TEST(RunControls, OverfitBatchesTrainsAndValidatesOnTheSameFirstBatches) {
  auto train = MakeData(64, 1);
  for (double overfit : {2.0, 0.5, 1.0}) {
    const int64_t n = overfit == 1.0 ? 1 : 2;  // 0.5 of 4 batches = 2; 1 = one batch
    TrainerOptions o = Options(TmpDir("overfit"));
    o.num_sanity_val_steps = 0;
    o.overfit_batches = overfit;  // shuffle stays true: overfitting turns it off
    auto runs = FitCounting(2, o);
    for (int rank = 0; rank < 2; ++rank) {
      const auto& r = runs[rank];
      // Rank r's unshuffled batch k starts with sample r + 2 * 8 * k.
      std::vector<double> firsts;
      for (int64_t k = 0; k < n; ++k) firsts.push_back(train->get_batch({rank + 16 * k}).inputs[0][0].item<double>());
      std::vector<double> expected;
      for (int e = 0; e < 3; ++e) expected.insert(expected.end(), firsts.begin(), firsts.end());
      EXPECT_EQ(r.train_first, expected) << "overfit_batches " << overfit << " rank " << rank;
      EXPECT_EQ(r.val_first, expected) << "validation must run on the same training batches";
      EXPECT_EQ(r.global_step, 3 * n);
      EXPECT_FALSE(r.effective.shuffle);
    }
  }
}

TEST(RunControls, LimitBatchesPerStage) {
  TrainerOptions o;
  o.limit_train_batches = 0.5;
  o.limit_val_batches = 3;
  o.limit_test_batches = 0.25;
  o.limit_predict_batches = 2;
  EXPECT_EQ(LimitBatches(o, Stage::kFit, 10), 5);
  EXPECT_EQ(LimitBatches(o, Stage::kValidate, 10), 3);
  EXPECT_EQ(LimitBatches(o, Stage::kTest, 10), 2);
  EXPECT_EQ(LimitBatches(o, Stage::kPredict, 10), 2);
  EXPECT_EQ(LimitBatches(o, Stage::kPredict, 1), 1);
  o.overfit_batches = 4;  // train and validate only
  EXPECT_EQ(LimitBatches(o, Stage::kFit, 10), 4);
  EXPECT_EQ(LimitBatches(o, Stage::kValidate, 10), 4);
  EXPECT_EQ(LimitBatches(o, Stage::kTest, 10), 2);
  o.fast_dev_run = 1;  // every stage
  for (Stage s : {Stage::kFit, Stage::kValidate, Stage::kTest, Stage::kPredict}) EXPECT_EQ(LimitBatches(o, s, 10), 1);
  // Checked at construction.
  TrainerOptions bad;
  bad.limit_test_batches = -1;
  EXPECT_THROW(Trainer{bad}, InvalidArgumentError);
  bad = {};
  bad.check_val_every_n_epoch = 0;
  EXPECT_THROW(Trainer{bad}, InvalidArgumentError);
  bad = {};
  bad.num_sanity_val_steps = -2;
  EXPECT_THROW(Trainer{bad}, InvalidArgumentError);
  bad = {};
  bad.fast_dev_run = -1;
  EXPECT_THROW(Trainer{bad}, InvalidArgumentError);
}

// What exists already, counted: limit_train/val_batches, and an unset
// max_epochs with max_steps running past the old one-epoch default.
TEST(RunControls, LimitsAndMaxStepsWithoutMaxEpochs) {
  TrainerOptions o = Options(TmpDir("limits"));
  o.max_epochs = 2;
  o.num_sanity_val_steps = 0;
  o.limit_train_batches = 0.5;  // 2 of 4
  o.limit_val_batches = 3;      // 3 of 4
  for (const auto& r : FitCounting(2, o)) {
    EXPECT_EQ(r.train_steps, 4);
    EXPECT_EQ(r.val_steps, 6);
  }
  o = Options(TmpDir("max_steps_only"));
  o.max_epochs.reset();
  o.max_steps = 10;
  o.num_sanity_val_steps = 0;
  for (const auto& r : FitCounting(2, o)) {
    EXPECT_EQ(r.train_steps, 10);
    EXPECT_EQ(r.global_step, 10);
    EXPECT_EQ(r.epoch, 2);  // in the middle of the third epoch
  }
}

// training_step adds noise from torch's global generator.
class Noisy : public Classifier {
 public:
  at::Tensor training_step(const Batch& b, int64_t i) override {
    Batch noisy = b;
    noisy.inputs = b.inputs + at::randn(b.inputs.sizes()) * 0.5;
    return Classifier::training_step(noisy, i);
  }
};

std::vector<double> SeededLosses(uint64_t seed) {
  SeedEverything(seed);
  TrainerOptions o = BaseOptions(TmpDir("seeded"), 1);
  o.seed = 0;  // not given: SeedEverything's
  o.enable_model_summary = false;
  o.enable_checkpointing = false;
  Noisy module;
  Trainer trainer(o);
  EXPECT_EQ(trainer.options().seed, seed);
  trainer.Fit(module, *MakeData(64, 1));
  return trainer.step_losses();
}

TEST(RunControls, SeedEverythingMakesRunsBitIdentical) {
  const auto a = SeededLosses(5);
  const auto b = SeededLosses(5);
  const auto c = SeededLosses(6);
  internal::ClearGlobalSeed();
  ASSERT_EQ(a.size(), 12u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a.front(), c.front());  // the shuffle and the noise differ from the first step
  // It seeds torch's CPU generator.
  SeedEverything(9, /*workers=*/true);
  const at::Tensor x = at::randn({4});
  at::manual_seed(9);
  EXPECT_TRUE(at::equal(x, at::randn({4})));
  EXPECT_TRUE(SeedWorkers());
  EXPECT_EQ(GlobalSeed().value_or(0), 9u);
  EXPECT_NE(WorkerSeed(9, 0, 0), WorkerSeed(9, 0, 1));
  EXPECT_NE(WorkerSeed(9, 0, 1), WorkerSeed(9, 1, 0));
  EXPECT_EQ(WorkerSeed(9, 1, 2), WorkerSeed(9, 1, 2));
  internal::ClearGlobalSeed();
}

// Uses Tensor::put_, which has no deterministic CPU implementation.
class UsesPut : public Classifier {
 public:
  at::Tensor training_step(const Batch& b, int64_t i) override {
    at::Tensor t = at::zeros({4});
    t.put_(at::arange(2), at::ones({2}));
    return Classifier::training_step(b, i) + t.sum() * 0;
  }
};

TEST(RunControls, DeterministicFailsClearlyOnANondeterministicOperation) {
  TrainerOptions o = BaseOptions(TmpDir("deterministic"), 1);
  o.enable_model_summary = false;
  o.max_steps = 1;
  o.deterministic = true;
  UsesPut module;
  Trainer trainer(o);
  try {
    trainer.Fit(module, *MakeData(64, 1));
    ADD_FAILURE() << "expected an error";
  } catch (const InvalidArgumentError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("deterministic=true"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'put_'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("deterministic=false"), std::string::npos) << msg;
  }
  EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
  at::globalContext().setDeterministicAlgorithms(false, false);
  o.deterministic = false;  // the same module trains without it
  UsesPut again;
  Trainer plain(o);
  plain.Fit(again, *MakeData(64, 1));
  EXPECT_EQ(plain.global_step(), 1);
}

// Records the global step each Fit starts at.
class StartStep : public Callback {
 public:
  void on_fit_start(Trainer& t, TrainingModule&) override { steps.push_back(t.global_step()); }
  std::vector<int64_t> steps;
};

TEST(RunControls, CkptPathBestResumesFromModelCheckpointsBest) {
  const std::string root = TmpDir("best");
  TrainerOptions o = Options(root);
  o.num_sanity_val_steps = 0;
  o.val_batch_size = 8;
  auto train = MakeData(64, 1);
  auto val = MakeData(16, 2);
  std::vector<std::string> best(2);
  std::vector<std::vector<int64_t>> starts(2);
  std::vector<int64_t> resumed_epoch(2);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    ModelCheckpointOptions mo;
    mo.monitor = "val_loss";
    auto mc = std::make_shared<ModelCheckpoint>(mo);
    auto start = std::make_shared<StartStep>();
    TrainerOptions mine = o;
    mine.callbacks = {mc, start};
    {
      Counting module;
      module.scripted_val = {3.0, 1.0, 2.0};  // best after epoch 1: step 8
      Trainer first(mine, comm);
      first.Fit(module, *train, val.get());
    }
    best[rank] = mc->best_model_path();
    mine.max_epochs = 4;
    Counting module;
    module.scripted_val = {5.0};
    Trainer second(mine, comm);
    second.Fit(module, *train, val.get(), "best");
    starts[rank] = start->steps;
    resumed_epoch[rank] = static_cast<int64_t>(module.train_first.size());
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(best[rank].find("step=8"), std::string::npos) << best[rank];
    EXPECT_EQ(starts[rank], (std::vector<int64_t>{0, 8}));
    EXPECT_EQ(resumed_epoch[rank], 2 * 4);  // epochs 2 and 3 of 4
  }
}

TEST(RunControls, CkptPathBestWithoutABestIsAClearError) {
  auto train = MakeData(64, 1);
  auto expect_error = [&](std::vector<CallbackPtr> callbacks, const std::string& part) {
    TrainerOptions o = BaseOptions(TmpDir("best_errors"), 1);
    o.enable_model_summary = false;
    o.callbacks = std::move(callbacks);
    Classifier module;
    Trainer trainer(o);
    try {
      trainer.Fit(module, *train, nullptr, "best");
      ADD_FAILURE() << "expected an error with '" << part << "'";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error({}, "needs a ModelCheckpoint callback");
  expect_error({std::make_shared<ModelCheckpoint>()}, "has no monitor");
  ModelCheckpointOptions mo;
  mo.monitor = "val_loss";
  expect_error({std::make_shared<ModelCheckpoint>(mo)}, "has not saved a checkpoint yet");
}

// fixtures::NetImpl: b1 = Linear(8, 16) (144), b2 = Linear(16, 16) (272),
// head = Linear(16, 3) (51, in the root unit); Adam: 2 states per element.
TEST(ModelSummary, UnitsAndShardSizesAtTwoRanks) {
  auto train = MakeData(64, 1);
  for (const std::string strategy : {"fsdp_native", "ddp"}) {
    for (bool enabled : {true, false}) {
      TrainerOptions o = BaseOptions(TmpDir("summary"), 2);
      o.strategy = strategy;
      o.max_steps = 1;
      o.enable_checkpointing = false;
      o.enable_logger = false;
      o.enable_model_summary = enabled;
      std::vector<ModelSummary> summaries(2);
      ::testing::internal::CaptureStdout();
      shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
        Classifier module;
        Trainer trainer(o, comm);
        trainer.Fit(module, *train);
        summaries[rank] = SummarizeModel(trainer.strategy(), trainer.optimizer());
      });
      const std::string out = ::testing::internal::GetCapturedStdout();
      size_t printed = 0;
      for (size_t p = out.find("Model summary ("); p != std::string::npos; p = out.find("Model summary (", p + 1)) {
        ++printed;
      }
      EXPECT_EQ(printed, enabled ? 1u : 0u) << "rank 0 prints it once when enabled:\n" << out;
      if (enabled) {
        EXPECT_NE(out.find("Total"), std::string::npos) << out;
        std::cerr << out;
      }
      struct Row {
        std::string name;
        int64_t params, stored;
      };
      const std::vector<Row> expected = strategy == "ddp"
                                            ? std::vector<Row>{{"b1", 144, 144}, {"b2", 272, 272}, {"head", 51, 51}}
                                            : std::vector<Row>{{"b1", 144, 72}, {"b2", 272, 136}, {"(root)", 51, 26}};
      for (const auto& s : summaries) {
        EXPECT_EQ(s.optimizer, "Adam");
        EXPECT_EQ(s.optimizer_states, 2);
        EXPECT_EQ(s.world_size, 2);
        ASSERT_EQ(s.rows.size(), expected.size()) << strategy;
        int64_t stored = 0;
        for (size_t i = 0; i < expected.size(); ++i) {
          EXPECT_EQ(s.rows[i].name, expected[i].name) << strategy;
          EXPECT_EQ(s.rows[i].parameters, expected[i].params) << strategy << " " << expected[i].name;
          EXPECT_EQ(s.rows[i].trainable, expected[i].params);
          EXPECT_EQ(s.rows[i].shard_elements, expected[i].stored) << strategy << " " << expected[i].name;
          EXPECT_EQ(s.rows[i].param_bytes, expected[i].stored * 4);
          EXPECT_EQ(s.rows[i].bytes_per_rank, expected[i].stored * 4 * (1 + 1 + 2));  // params, grads, Adam's 2
          stored += expected[i].stored;
        }
        EXPECT_EQ(s.total.parameters, 467);
        EXPECT_EQ(s.total.shard_elements, stored);
        EXPECT_EQ(s.total.bytes_per_rank, stored * 16);
      }
    }
  }
}

}  // namespace
}  // namespace shardtrain::trainer
