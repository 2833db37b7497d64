// Profilers of Trainer::Fit (trainer/profilers/profiler.h): the simple profiler's
// phases, calls and report file at W=2; the communication wait it reports
// (comm/wait_time.h) is the time blocked in Work::Wait; profiler="pytorch"
// writes a Chrome trace of the chosen batches; option errors; off is off.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "base/errors.h"
#include "comm/wait_time.h"
#include "tests/trainer/fixtures.h"
#include "trainer/profilers/profiler.h"

namespace shardtrain::trainer {
namespace {
namespace fs = std::filesystem;
using fixtures::BaseOptions;
using fixtures::TmpDir;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(WaitTime, CountsTheTimeBlockedInWaitOnTheSinksThread) {
  std::vector<comm::WaitTime> waits(2);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& group) {
    at::Tensor t = at::ones({4});
    group->AllReduce(t)->Wait();  // no sink installed: nothing counted anywhere
    comm::WaitTimeSink sink(&waits[rank]);
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    group->AllReduce(t)->Wait();  // rank 0 waits for rank 1
    group->Barrier()->Wait();
  });
  EXPECT_EQ(waits[0].calls, 2);
  EXPECT_EQ(waits[1].calls, 2);
  EXPECT_GE(waits[0].nanoseconds, 150'000'000);  // rank 0 was blocked while rank 1 slept
  EXPECT_LT(waits[1].nanoseconds, 150'000'000);
}

TEST(Profiler, SimpleReportsEveryPhaseAtTwoRanks) {
  const std::string root = TmpDir("profiler_simple");
  TrainerOptions o = BaseOptions(root, 2);
  o.max_epochs = 1;  // 4 training batches per rank, validation once, last.ckpt once
  o.profiler = "simple";
  std::vector<std::vector<ProfiledAction>> summaries(2);
  std::vector<std::vector<std::string>> written(2);
  const auto result = fixtures::Fit(2, o, "", {}, [&](int rank, Trainer& trainer, fixtures::Classifier&) {
    ASSERT_NE(trainer.profiler(), nullptr);
    summaries[rank] = trainer.profiler()->Summary();
    written[rank] = trainer.profiler()->written();
  });
  for (int rank = 0; rank < 2; ++rank) {
    std::map<std::string, ProfiledAction> by_name;
    for (const auto& a : summaries[rank]) by_name[a.action] = a;
    ASSERT_FALSE(summaries[rank].empty());
    EXPECT_EQ(summaries[rank].front().action, "fit");
    const double fit = by_name["fit"].total_s;
    const std::map<std::string, int64_t> calls = {
        {kActionGetTrainBatch, 4}, {kActionTrainingStep, 4},        {kActionBackward, 4},
        {kActionOptimizerStep, 4}, {kActionOnTrainBatchEnd, 4},     {kActionCallbacksOnTrainBatchEnd, 4},
        {kActionValidation, 1},    {kActionOnTrainEpochEnd, 1},     {kActionSaveCheckpoint, 1}};
    double phases = 0;
    for (const auto& [name, n] : calls) {
      ASSERT_TRUE(by_name.count(name)) << "rank " << rank << " has no row " << name;
      EXPECT_EQ(by_name[name].calls, n) << name;
      EXPECT_GT(by_name[name].total_s, 0) << name;
      if (name != kActionOnTrainEpochEnd) phases += by_name[name].total_s;  // disjoint phases
    }
    EXPECT_LE(phases, fit);
    // Two ranks: the step's all-reduce, DDP's gradients, validation and checkpoint collectives.
    EXPECT_GE(by_name[kActionCommunicationWait].calls, 4);
    EXPECT_GT(by_name[kActionCommunicationWait].total_s, 0);
    EXPECT_LT(by_name[kActionCommunicationWait].total_s, fit);
  }
  // The report: rank 0 only, in the run's directory.
  EXPECT_TRUE(written[1].empty());
  ASSERT_EQ(written[0].size(), 1u);
  EXPECT_EQ(written[0][0], (fs::path(result.log_dir) / "profiler-fit.txt").string());
  const std::string report = ReadFile(written[0][0]);
  for (const char* s : {"FIT Profiler Report", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %",
                        "| fit ", "training_step", "backward", "optimizer_step", "get_train_batch", "validation",
                        "save_checkpoint", "communication_wait"}) {
    EXPECT_NE(report.find(s), std::string::npos) << s << " missing from\n" << report;
  }
}

TEST(Profiler, OffMakesNoProfilerAndNoReport) {
  const std::string root = TmpDir("profiler_off");
  TrainerOptions o = BaseOptions(root, 1);
  o.max_epochs = 1;
  const auto result = fixtures::Fit(1, o, "", {}, [&](int, Trainer& trainer, fixtures::Classifier&) {
    EXPECT_EQ(trainer.profiler(), nullptr);
  });
  EXPECT_FALSE(fs::exists(fs::path(result.log_dir) / "profiler-fit.txt"));
}

TEST(Profiler, PytorchWritesAChromeTraceOfTheChosenBatches) {
  const std::string root = TmpDir("profiler_pytorch");
  TrainerOptions o = BaseOptions(root, 1);
  o.max_epochs = 1;  // 4 training batches: trace batches 1 and 2
  o.profiler = "pytorch";
  o.profiler_steps = "1:2";
  std::vector<std::string> written;
  const auto result = fixtures::Fit(1, o, "", {}, [&](int, Trainer& trainer, fixtures::Classifier&) {
    written = trainer.profiler()->written();
  });
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(written[0], (fs::path(result.log_dir) / "profiler-fit-rank0.pt.trace.json").string());
  const std::string trace = ReadFile(written[0]);
  EXPECT_NE(trace.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(trace.find("aten::"), std::string::npos);  // LibTorch's ops
  // The phases as user ranges: two batches of each.
  auto count = [&](const std::string& s) {
    int64_t n = 0;
    for (size_t p = trace.find(s); p != std::string::npos; p = trace.find(s, p + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("\"name\": \"training_step\""), 2) << trace.substr(0, 2000);
  EXPECT_EQ(count("\"name\": \"optimizer_step\""), 2);
  EXPECT_EQ(count("\"name\": \"backward\""), 2);
}

TEST(Profiler, OptionErrorsNameTheValidValues) {
  TrainerOptions o;
  o.profiler = "advanced";
  try {
    Trainer t(o);
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("\"simple\", \"pytorch\""), std::string::npos) << e.what();
  }
  o.profiler = "pytorch";
  for (const char* steps : {"3", "a:2", "1:0", "-1:2", "1:2:3", ":2"}) {
    o.profiler_steps = steps;
    try {
      Trainer t(o);
      FAIL() << steps;
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("\"wait:active\""), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace shardtrain::trainer
