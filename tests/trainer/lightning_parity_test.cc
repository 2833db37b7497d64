// Lightning-parity pieces of the Trainer: accelerator / devices resolution
// and its errors, estimated_stepping_batches (also from configure_optimizers),
// standalone Validate with its hooks and logging, and validation metrics
// logged at the global step at which validation ran (real Gloo ranks, real
// metrics.csv).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>

#include "base/errors.h"
#include "tests/trainer/fixtures.h"
#include "trainer/callbacks/callback.h"
#include "trainer/callbacks/early_stopping.h"
#include "trainer/plugins/accelerator.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;

std::string ConstructionError(const TrainerOptions& o) {
  try {
    Trainer t(o);
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "";
}

TEST(Accelerator, CudaWithoutCudaIsAClearError) {
  for (const std::string name : {"cuda", "gpu"}) {
    TrainerOptions o;
    o.accelerator = name;
    const std::string msg = ConstructionError(o);
    if (BuildHasCuda() && CudaDeviceCount() > 0) {
      EXPECT_EQ(msg, "") << "CUDA is available here: the error path is not reachable";
      continue;
    }
    SCOPED_TRACE(msg);
    EXPECT_NE(msg.find("accelerator '" + name + "' is not available"), std::string::npos);
    EXPECT_NE(msg.find(BuildHasCuda() ? "no CUDA device is visible" : "this build has no CUDA support (build with "
                                                                      "--config=cuda)"),
              std::string::npos);
    EXPECT_NE(msg.find("valid here: cpu, auto"), std::string::npos);
  }
  TrainerOptions o;
  o.accelerator = "tpu";
  EXPECT_NE(ConstructionError(o).find("unknown accelerator 'tpu'; valid: cpu, cuda, gpu (= cuda), auto"),
            std::string::npos)
      << ConstructionError(o);
}

TEST(Accelerator, AutoIsCpuWithoutCudaAndTrains) {
  if (BuildHasCuda() && CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible";
  EXPECT_EQ(ResolveAccelerator("auto"), "cpu");
  EXPECT_EQ(ResolveAccelerator("cpu"), "cpu");
  TrainerOptions o = BaseOptions(TmpDir("accel_auto"), 2);
  o.accelerator = "auto";
  o.devices = kAutoDevices;  // Lightning: devices="auto" on cpu is 1 process
  o.max_epochs = 1;
  o.strategy = "single_device";
  o.batch_size = 16;
  Trainer probe(o);
  EXPECT_EQ(probe.accelerator(), "cpu");
  EXPECT_EQ(probe.devices(), 1);
  FitResult r = Fit(1, o, "", {}, [](int, Trainer& t, Classifier&) {
    EXPECT_TRUE(t.device().is_cpu());
    EXPECT_EQ(t.accelerator(), "cpu");
  });
  EXPECT_EQ(r.losses.size(), 4u);
}

// The CUDA pieces of a build without --config=cuda (trainer/plugins/accelerator_cpu.cc,
// linked instead of accelerator_cuda.cc): no device, and asking for one or for
// NCCL is an error that says which build is needed.
TEST(Accelerator, CudaPiecesOfABuildWithoutCudaThrow) {
  if (BuildHasCuda()) GTEST_SKIP() << "built with --config=cuda";
  EXPECT_EQ(CudaDeviceCount(), 0);
  SetCurrentDevice(c10::Device(c10::kCPU));  // a no-op
  const auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const InvalidArgumentError& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_NE(error_of([] { SetCurrentDevice(c10::Device(c10::kCUDA, 0)); })
                .find("device cuda:0 needs a build with CUDA support (--config=cuda)"),
            std::string::npos);
  EXPECT_NE(error_of([] { CreateNcclCommunicator({}, 0, 1, 0, CommLimits{std::chrono::seconds(1)}); })
                .find("the NCCL communicator needs a build with CUDA support (--config=cuda)"),
            std::string::npos);
}

TEST(Accelerator, DevicesParsingAndChecks) {
  EXPECT_EQ(ParseDevices("auto"), kAutoDevices);
  EXPECT_EQ(ParseDevices("4"), 4);
  for (const std::string bad : {"0", "-2", "two", "", "1.5"}) {
    try {
      ParseDevices(bad);
      ADD_FAILURE() << "no error for --devices=" << bad;
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("--devices must be a number of ranks >= 1 or 'auto', got '" + bad + "'"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(ResolveDevices(kAutoDevices, "cpu"), 1);
  EXPECT_EQ(ResolveDevices(3, "cpu"), 3);
  TrainerOptions o;
  o.devices = 0;
  EXPECT_NE(ConstructionError(o).find("devices must be >= 1 or kAutoDevices"), std::string::npos);
}

TEST(Trainer, EstimatedSteppingBatches) {
  auto train = MakeData(64, 1);  // 2 ranks x batch 8: 4 batches per rank per epoch
  auto odd = MakeData(70, 1);    // 35 per rank: 4 full batches and a partial one
  struct Case {
    int64_t max_epochs, max_steps, accumulate;
    double limit;
    bool drop_last;
    const Dataset* data;
    int64_t expected;
  };
  const std::vector<Case> cases = {
      {3, -1, 1, 1.0, false, train.get(), 12}, {3, -1, 3, 1.0, false, train.get(), 6},  // ceil(4/3) * 3
      {3, 5, 1, 1.0, false, train.get(), 5},   {3, -1, 1, 0.5, false, train.get(), 6},  // 2 batches * 3
      {3, -1, 1, 3.0, false, train.get(), 9},  {-1, 7, 1, 1.0, false, train.get(), 7},
      {2, -1, 1, 1.0, false, odd.get(), 10},
      {2, -1, 1, 1.0, true, odd.get(), 8},     {0, -1, 1, 1.0, false, train.get(), 4},  // max(max_epochs, 1)
  };
  shardtrain::testing::RunRanks(2, [&](int, const auto& comm) {
    for (const auto& c : cases) {
      TrainerOptions o;
      o.max_epochs = c.max_epochs;
      o.max_steps = c.max_steps;
      o.accumulate_grad_batches = c.accumulate;
      o.limit_train_batches = c.limit;
      o.drop_last = c.drop_last;
      o.batch_size = 8;
      Trainer t(o, comm);
      EXPECT_EQ(t.estimated_stepping_batches(*c.data), c.expected)
          << "max_epochs " << c.max_epochs << " max_steps " << c.max_steps << " accumulate " << c.accumulate
          << " limit " << c.limit << " drop_last " << c.drop_last;
      EXPECT_THROW(t.estimated_stepping_batches(), InvalidArgumentError);  // no Fit yet
    }
  });
}

// Reads trainer().estimated_stepping_batches() where Lightning users do: in
// configure_optimizers (a schedule that needs the total).
class StepsAwareClassifier : public Classifier {
 public:
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    estimated = trainer().estimated_stepping_batches();
    return Classifier::configure_optimizers(params);
  }
  int64_t estimated = -2;
};

TEST(Trainer, EstimatedSteppingBatchesInsideFitMatchesTheRun) {
  for (int64_t accumulate : {1, 3}) {
    TrainerOptions o = BaseOptions(TmpDir("estimate_fit"), 2);
    o.accumulate_grad_batches = accumulate;
    o.strategy = "fsdp_native";
    auto train = MakeData(64, 1);
    std::mutex mu;
    std::vector<int64_t> estimated, taken;
    shardtrain::testing::RunRanks(2, [&](int, const auto& comm) {
      StepsAwareClassifier module;
      Trainer trainer(o, comm);
      trainer.Fit(module, *train);
      std::lock_guard<std::mutex> lock(mu);
      estimated.push_back(module.estimated);
      taken.push_back(trainer.global_step());
      EXPECT_EQ(trainer.estimated_stepping_batches(), module.estimated);
    });
    ASSERT_EQ(estimated.size(), 2u);
    EXPECT_EQ(estimated[0], accumulate == 1 ? 12 : 6);
    EXPECT_EQ(estimated[0], taken[0]);
    EXPECT_EQ(estimated[1], taken[1]);
  }
}

// Counts the module's validation hooks and logs an accuracy from validation_step.
class HookedClassifier : public Classifier {
 public:
  std::optional<at::Tensor> validation_step(const Batch& b, int64_t i) override {
    at::Tensor out = forward([&] { return net_->forward(b.inputs); });
    log("val_acc", out.argmax(1).eq(b.targets).to(at::kFloat).mean().item<double>());
    return at::cross_entropy_loss(out.to(at::kFloat), b.targets);
  }
  void on_validation_start() override { ++starts; }
  void on_validation_end() override { ++ends; }
  int starts = 0, ends = 0;
};

// Records, per validation, whether it ran inside Fit and at which global step.
class ValidationRecorder : public Callback {
 public:
  void on_validation_start(Trainer& t, TrainingModule&) override { started.push_back(t.global_step()); }
  void on_validation_end(Trainer& t, TrainingModule&) override {
    ended.emplace_back(t.global_step(), t.fitting());
    ASSERT_TRUE(t.callback_metrics().count("val_loss"));
    ASSERT_TRUE(t.callback_metrics().count("val_acc"));
  }
  std::vector<int64_t> started;
  std::vector<std::pair<int64_t, bool>> ended;
};

// Rows of metrics.csv with a value in `column`: (step, value).
std::vector<std::pair<int64_t, double>> CsvColumn(const std::string& path, const std::string& column) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  std::vector<std::string> header;
  std::stringstream hs(line);
  for (std::string h; std::getline(hs, h, ',');) header.push_back(h);
  size_t step_col = header.size(), col = header.size();
  for (size_t i = 0; i < header.size(); ++i) {
    if (header[i] == "step") step_col = i;
    if (header[i] == column) col = i;
  }
  std::vector<std::pair<int64_t, double>> out;
  if (step_col == header.size() || col == header.size()) return out;
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream ls(line);
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    cells.resize(header.size());
    if (!cells[col].empty()) out.emplace_back(std::stoll(cells[step_col]), std::stod(cells[col]));
  }
  return out;
}

TEST(Trainer, ValidateRunsHooksAndLogsAtTheGlobalStep) {
  const std::string root = TmpDir("validate_hooks");
  TrainerOptions o = BaseOptions(root, 2);
  o.strategy = "fsdp_native";
  o.val_check_interval = 2;  // every 2 training batches: steps 2, 4, 6, ... (4 batches per epoch)
  o.log_every_n_steps = 1;
  auto train = MakeData(64, 1);
  auto val = MakeData(16, 2);
  std::mutex mu;
  std::string log_dir;
  std::vector<std::pair<int64_t, bool>> ended0;
  std::vector<double> standalone_losses;
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    HookedClassifier module;
    auto recorder = std::make_shared<ValidationRecorder>();
    EarlyStoppingOptions eo;
    eo.patience = 100;
    auto early = std::make_shared<EarlyStopping>(eo);
    TrainerOptions mine = o;
    mine.callbacks = {recorder, early};
    Trainer trainer(mine, comm);
    const double before = trainer.Validate(module, *val);  // Lightning: trainer.validate(model) before fit
    EXPECT_FALSE(trainer.fitting());
    EXPECT_EQ(early->best_score(), std::numeric_limits<double>::infinity()) << "EarlyStopping acted outside Fit";
    EXPECT_TRUE(std::isfinite(before));
    EXPECT_EQ(trainer.callback_metrics().at("val_loss"), before);
    trainer.Fit(module, *train, val.get());
    const int64_t waits = early->wait_count();
    const double best = early->best_score();
    EXPECT_LT(best, before);  // it did check inside Fit
    const double after = trainer.Validate(module, *val);
    EXPECT_EQ(early->wait_count(), waits) << "EarlyStopping acted outside Fit";
    EXPECT_EQ(early->best_score(), best);
    EXPECT_EQ(module.starts, module.ends);
    EXPECT_EQ(module.starts, 1 + 6 + 1);
    EXPECT_EQ(recorder->started.size(), recorder->ended.size());
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) {
      log_dir = trainer.log_dir();
      ended0 = recorder->ended;
      standalone_losses = {before, after};
    }
  });
  const std::vector<std::pair<int64_t, bool>> expected = {{0, false}, {2, true},  {4, true},  {6, true},
                                                          {8, true},  {10, true}, {12, true}, {12, false}};
  EXPECT_EQ(ended0, expected);
  // One logger version for Validate and Fit; every validation is a row at its global step.
  EXPECT_EQ(log_dir, (fs::path(root) / "lightning_logs" / "version_0").string());
  const auto val_rows = CsvColumn((fs::path(log_dir) / "metrics.csv").string(), "val_loss");
  std::vector<int64_t> steps;
  for (const auto& [step, v] : val_rows) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 2, 4, 6, 8, 10, 12, 12}));
  ASSERT_EQ(val_rows.size(), 8u);
  EXPECT_NEAR(val_rows.front().second, standalone_losses[0], 1e-7);  // metrics.csv keeps 9 digits
  EXPECT_NEAR(val_rows.back().second, standalone_losses[1], 1e-7);
  EXPECT_LT(standalone_losses[1], standalone_losses[0]);
  const auto acc_rows = CsvColumn((fs::path(log_dir) / "metrics.csv").string(), "val_acc");
  ASSERT_EQ(acc_rows.size(), 8u);
  for (const auto& [step, acc] : acc_rows) {
    EXPECT_GE(acc, 0.0);
    EXPECT_LE(acc, 1.0);
  }
  EXPECT_GT(acc_rows.back().second, acc_rows.front().second);
}

}  // namespace
}  // namespace shardtrain::trainer
