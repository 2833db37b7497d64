// Trainer: the one per-step collective, stop signals (threads-as-ranks:
// raise() reaches the process-wide flag every rank's Fit folds into its step
// collective), ckpt_path="last", resume="auto", litter cleanup, last.ckpt as a
// hard link, hparams with full precision. Real processes: preemption_test.sh.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "base/errors.h"
#include "tests/testing/multi_rank.h"
#include "tests/trainer/fixtures.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/resume.h"
#include "trainer/loggers/logger.h"
#include "trainer/stop_signals.h"

namespace shardtrain::trainer {
namespace {
namespace fs = std::filesystem;
using fixtures::Classifier;
using fixtures::MakeData;
using fixtures::TmpDir;

void WritePlain(const fs::path& p, const std::string& s) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << s;
}

// AllReduce calls one rank made during a Fit of `steps` optimizer steps.
int64_t AllReducesOfFit(int64_t steps, bool with_callback) {
  auto train = MakeData(64, 1);
  TrainerOptions o = fixtures::BaseOptions(TmpDir("count_" + std::to_string(steps)), 2);
  o.strategy = "fsdp_native";
  o.max_steps = steps;
  o.enable_checkpointing = false;
  fixtures::ClassifierConfig c;
  c.log_accuracy = true;  // one logged metric besides the loss
  std::atomic<int64_t> calls{0};
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    Classifier module(c);
    TrainerOptions mine = o;
    if (with_callback) mine.callbacks = {std::make_shared<Callback>()};
    Trainer trainer(mine, comm);
    trainer.Fit(module, *train);
    if (rank == 0) calls = comm->stats().Calls(comm::CommOp::kAllReduce);
  });
  return calls;
}

TEST(StepCollective, OneAllReducePerOptimizerStep) {
  // Loss, the logged metric, should-stop and the signal flags travel in one tensor.
  EXPECT_EQ(AllReducesOfFit(6, false) - AllReducesOfFit(3, false), 3);
  // With callbacks too (a stop they request in on_train_batch_end travels in
  // the next collective), plus the should-stop all-reduce at the end of epoch
  // 0 (after step 4).
  EXPECT_EQ(AllReducesOfFit(6, true) - AllReducesOfFit(3, true), 3 + 1);
}

// Raises `sig` in on_train_batch_end on rank 1 after global step `at`.
class RaiseAt : public Callback {
 public:
  RaiseAt(int sig, int64_t at) : sig_(sig), at_(at) {}
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t) override {
    if (t.rank() == 1 && t.global_step() == at_) raise(sig_);
  }

 private:
  int sig_;
  int64_t at_;
};

struct StopResult {
  int signal[2] = {0, 0};
  int64_t step[2] = {-1, -1};
  std::string checkpoint, message;
  std::vector<double> losses;
};

StopResult FitUntilSignal(const TrainerOptions& o, int sig, int64_t at) {
  auto train = MakeData(64, 1);
  StopResult r;
  std::mutex mu;
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    Classifier module;
    TrainerOptions mine = o;
    mine.callbacks = {std::make_shared<RaiseAt>(sig, at)};
    Trainer trainer(mine, comm);
    try {
      trainer.Fit(module, *train);
    } catch (const Preempted& e) {
      std::lock_guard<std::mutex> lock(mu);
      r.signal[rank] = e.signal();
      r.step[rank] = trainer.global_step();
      if (rank == 0) {
        r.checkpoint = e.checkpoint();
        r.message = e.what();
        r.losses = trainer.step_losses();
      }
    }
  });
  return r;
}

std::vector<double> FitLosses(const TrainerOptions& o, const std::string& ckpt_path) {
  auto train = MakeData(64, 1);
  std::vector<double> losses;
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    Classifier module;
    Trainer trainer(o, comm);
    trainer.Fit(module, *train, nullptr, ckpt_path);
    if (rank == 0) losses = trainer.step_losses();
  });
  return losses;
}

TEST(Preemption, SignalOnOneRankStopsEveryRankAfterTheStepAndResumesExactly) {
  TrainerOptions o = fixtures::BaseOptions(TmpDir("preempt"), 2);
  o.strategy = "fsdp_native";
  const std::vector<double> full = FitLosses(o, "");
  ASSERT_EQ(full.size(), 12u);
  o.default_root_dir = TmpDir("preempt_run");
  StopResult r = FitUntilSignal(o, SIGUSR1, 3);
  // Raised after step 3 on rank 1: every rank finishes step 4, then stops.
  EXPECT_EQ(r.signal[0], SIGUSR1);
  EXPECT_EQ(r.signal[1], SIGUSR1);
  EXPECT_EQ(r.step[0], 4);
  EXPECT_EQ(r.step[1], 4);
  EXPECT_EQ(StopExitCode(SIGUSR1), 138);
  EXPECT_EQ(StopExitCode(SIGTERM), 143);
  EXPECT_EQ(StopExitCode(SIGINT), 130);
  EXPECT_EQ(fs::path(r.checkpoint).filename(), "last.ckpt");
  EXPECT_EQ(LoadCheckpoint(r.checkpoint).global_step, 4);
  EXPECT_NE(r.message.find("stopped by SIGUSR1 after global step 4"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("--ckpt_path=last"), std::string::npos) << r.message;
  // Auto-resume continues bit for bit.
  o.resume = "auto";
  const std::vector<double> rest = FitLosses(o, "");
  ASSERT_EQ(rest.size(), 8u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(r.losses[i], full[i]) << "step " << i + 1;
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(rest[i], full[4 + i]) << "step " << i + 5;
}

TEST(Resume, LastIsTheNewestCompleteCheckpointOfAnyRun) {
  const fs::path root = TmpDir("find_last");
  EXPECT_EQ(FindLatestCheckpoint(root.string(), "lightning_logs"), "");
  const fs::path v0 = root / "lightning_logs" / "version_0" / "checkpoints";
  const fs::path v1 = root / "lightning_logs" / "version_1" / "checkpoints";
  WritePlain(v0 / "last.ckpt", "old");
  WritePlain(v1 / "step=110.ckpt", "new");
  WritePlain(v1 / ".step=120.ckpt.tmp.123", "partial");         // a save in progress or killed
  fs::create_directories(v1 / "step=130.ckpt");                 // sharded, no COMPLETE marker
  fs::create_directories(root / "lightning_logs" / "version_2");  // a newer run that saved nothing
  const auto now = fs::file_time_type::clock::now();
  fs::last_write_time(v0 / "last.ckpt", now - std::chrono::hours(2));
  fs::last_write_time(v1 / "step=110.ckpt", now - std::chrono::hours(1));
  EXPECT_EQ(FindLatestCheckpoint(root.string(), "lightning_logs"), (v1 / "step=110.ckpt").string());
  WritePlain(v1 / "step=130.ckpt" / kCompleteMarkerName, "");
  EXPECT_EQ(FindLatestCheckpoint(root.string(), "lightning_logs"), (v1 / "step=130.ckpt").string());
}

TEST(Litter, KilledSavesAreRemovedAtTheNextStartAndAFailedResumeLeavesNoRun) {
  TrainerOptions o = fixtures::BaseOptions(TmpDir("litter"), 2);
  o.strategy = "ddp";
  o.max_steps = 6;  // ends in the middle of epoch 1 (4 steps per epoch)
  o.checkpoint_every_n_steps = 3;
  const fs::path old = fs::path(o.default_root_dir) / "lightning_logs" / "version_0" / "checkpoints";
  const std::string dead = (old / ".last.ckpt.tmp.2147480000").string();  // no such pid
  const std::string live = (old / (".last.ckpt.tmp." + std::to_string(getpid()))).string();
  WritePlain(dead, "x");
  WritePlain(live, "x");
  WritePlain(old / ".step=4.ckpt.tmp-sharded" / "rank_0.pt", "x");
  // A resume that fails (not a checkpoint) makes no version_1.
  WritePlain(fs::path(o.default_root_dir) / "bad.ckpt", "not a checkpoint");
  EXPECT_THROW(FitLosses(o, (fs::path(o.default_root_dir) / "bad.ckpt").string()), std::exception);
  EXPECT_FALSE(fs::exists(fs::path(o.default_root_dir) / "lightning_logs" / "version_1"));
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live)) << "a temporary of a live process stays";
  EXPECT_FALSE(fs::exists(old / ".step=4.ckpt.tmp-sharded"));
  // The final step is on disk once: last.ckpt is a hard link to step=6.ckpt.
  FitLosses(o, "");
  const fs::path ck = fs::path(o.default_root_dir) / "lightning_logs" / "version_1" / "checkpoints";
  ASSERT_TRUE(fs::exists(ck / "step=6.ckpt"));
  EXPECT_TRUE(fs::equivalent(ck / "step=6.ckpt", ck / "last.ckpt"));
  EXPECT_EQ(fs::hard_link_count(ck / "last.ckpt"), 2u);
  EXPECT_EQ(LoadCheckpoint((ck / "last.ckpt").string()).global_step, 6);
}

TEST(Options, ResumeAndTimeoutAreChecked) {
  TrainerOptions o;
  o.resume = "always";
  try {
    Trainer t(o);
    FAIL() << "no error";
  } catch (const InvalidArgumentError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("resume must be one of \"never\", \"auto\", got \"always\""), std::string::npos) << what;
  }
  o.resume = "auto";
  o.timeout = std::chrono::milliseconds(0);
  EXPECT_THROW(Trainer t(o), InvalidArgumentError);
  // ckpt_path="last" with nothing saved: says where it looked.
  TrainerOptions none = fixtures::BaseOptions(TmpDir("no_last"), 1);
  try {
    FitLosses(none, "last");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no complete checkpoint"), std::string::npos) << e.what();
  }
}

TEST(Hparams, SmallNumbersKeepTheirDigits) {
  EXPECT_EQ(HparamValue(1e-7), "1e-07");
  EXPECT_EQ(HparamValue(2.5e-4), "0.00025");  // the shorter of fixed and scientific
  EXPECT_EQ(std::stod(HparamValue(0.1 + 0.2)), 0.1 + 0.2);
  const std::string dir = TmpDir("hparams");
  WriteHparamsYaml(dir, {{"lr", HparamValue(1e-7)}, {"name", "a:b"}});
  std::ifstream in(fs::path(dir) / "hparams.yaml");
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(all, "lr: 1e-07\nname: 'a:b'\n");
}

}  // namespace
}  // namespace shardtrain::trainer
