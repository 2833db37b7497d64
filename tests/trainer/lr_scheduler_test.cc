// Learning-rate schedulers through the Trainer (real Gloo ranks,
// fsdp_native at W=2): interval "step" with a frequency and "epoch" chained
// on one optimizer, LearningRateMonitor's Lightning names, exact resume
// mid-schedule from full and sharded checkpoints (cosine + step, warmup +
// plateau, one-cycle with beta1), ReduceLROnPlateau's missing metric, and
// configuration errors. The formulas themselves are checked against Python
// by lr_scheduler_python_test.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "base/errors.h"
#include "tests/trainer/fixtures.h"
#include "trainer/callbacks/callback.h"
#include "trainer/callbacks/learning_rate_monitor.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/optim/lr_scheduler.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;

// The Classifier with the schedulers of `kind`.
class Scheduled : public Classifier {
 public:
  Scheduled(std::string kind, ClassifierConfig c) : Classifier(std::move(c)), kind_(std::move(kind)) {}
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    OptimizerConfig c;
    if (kind_ == "onecycle") {
      c.optimizer = std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(2e-2));
    } else {
      c.optimizer = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    }
    auto opt = c.optimizer;
    if (kind_ == "cosine_step") {
      // Chained on one optimizer: cosine every 2nd step, x0.5 every 2nd epoch.
      c.lr_schedulers.push_back({std::make_shared<StepLR>(opt, 2, 0.5), "epoch"});
      LRSchedulerConfig cos{std::make_shared<CosineAnnealingLR>(opt, 8, 0.0), "step", 2};
      if (name_second_) cos.name = "cosine";
      c.lr_schedulers.push_back(cos);
    } else if (kind_ == "warmup_plateau") {
      auto warm = std::make_shared<LinearLR>(opt, 0.25, 1.0, 3);
      auto cos = std::make_shared<CosineAnnealingLR>(opt, 20, 0.0);
      c.lr_schedulers.push_back({std::make_shared<SequentialLR>(opt, std::vector<LRSchedulerPtr>{warm, cos},
                                                                std::vector<int64_t>{3}),
                                 "step"});
      ReduceLROnPlateauOptions p;
      p.patience = 0;
      p.factor = 0.5;
      LRSchedulerConfig plateau{std::make_shared<ReduceLROnPlateau>(opt, p), "epoch"};
      plateau.monitor = monitor_;
      plateau.strict = strict_;
      c.lr_schedulers.push_back(plateau);
    } else if (kind_ == "onecycle") {
      OneCycleOptions oc;
      oc.max_lr = 0.05;
      oc.total_steps = 12;
      c.lr_schedulers.push_back({std::make_shared<OneCycleLR>(opt, oc), "step"});
    } else if (kind_ == "step_only") {
      c.lr_schedulers.push_back({std::make_shared<StepLR>(opt, 2), "epoch"});
    } else if (kind_ == "other_optimizer") {
      auto other = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{at::zeros({2}, at::requires_grad())},
                                                       torch::optim::SGDOptions(0.1));
      c.lr_schedulers.push_back({std::make_shared<StepLR>(other, 2), "epoch"});
    } else if (kind_ == "bad_interval") {
      c.lr_schedulers.push_back({std::make_shared<StepLR>(opt, 2), "batch"});
    }
    return c;
  }
  std::string kind_;
  bool name_second_ = false;
  std::string monitor_ = "val_loss";
  bool strict_ = true;
};

// Records the optimizer's lrs and momentum after every optimizer step.
class LrRecorder : public Callback {
 public:
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t) override {
    lrs[t.global_step()] = t.learning_rates();
    momentums[t.global_step()] = GroupMomentums(*t.optimizer());
  }
  std::map<int64_t, std::vector<double>> lrs, momentums;
};

struct SchedRun {
  std::vector<double> losses;
  std::map<int64_t, std::vector<double>> lrs, momentums;
  std::vector<std::pair<int64_t, std::map<std::string, double>>> monitor;
  std::string ckpt_dir;
};

SchedRun FitScheduled(const std::string& kind, const TrainerOptions& o, const std::string& ckpt = "",
                 const std::function<void(Scheduled&)>& tweak = nullptr, ClassifierConfig cc = {}) {
  auto train = MakeData(64, 1);
  auto val = MakeData(16, 2);
  SchedRun run;
  std::mutex mu;
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    Scheduled module(kind, cc);
    if (tweak) tweak(module);
    auto rec = std::make_shared<LrRecorder>();
    auto mon = std::make_shared<LearningRateMonitor>();
    TrainerOptions mine = o;
    mine.callbacks = {rec, mon};
    Trainer trainer(mine, comm);
    trainer.Fit(module, *train, val.get(), ckpt);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      run.losses = trainer.step_losses();
      run.lrs = rec->lrs;
      run.momentums = rec->momentums;
      run.monitor = mon->history();
      run.ckpt_dir = trainer.checkpoint_dir();
    }
  });
  return run;
}

TrainerOptions Options(const std::string& name, const std::string& state_dict_type = "full") {
  TrainerOptions o = BaseOptions(TmpDir(name), 2);  // 3 epochs of 4 steps
  o.strategy = "fsdp_native";
  o.strategy_options = {{"state_dict_type", state_dict_type}};
  return o;
}

TEST(LRSchedulers, StepAndEpochIntervalsChainOnOneOptimizer) {
  SchedRun r = FitScheduled("cosine_step", Options("sched_chain"), "", [](Scheduled& m) { m.name_second_ = true; });
  ASSERT_EQ(r.lrs.size(), 12u);
  for (int64_t s = 1; s <= 12; ++s) {
    // Cosine (T_max 8) stepped at global steps 2, 4, ...; StepLR (x0.5 every
    // 2 epochs) at epoch ends, after the epoch's last on_train_batch_end.
    const int64_t cos_t = s / 2;
    const int64_t epochs_done = (s - 1) / 4;
    const double want = 0.1 * (1 + std::cos(M_PI * cos_t / 8.0)) / 2 * std::pow(0.5, epochs_done / 2);
    ASSERT_EQ(r.lrs[s].size(), 1u);
    EXPECT_NEAR(r.lrs[s][0], want, 1e-12 * 0.1) << "after step " << s;
  }
  // LearningRateMonitor: one entry per scheduler, Lightning's names.
  ASSERT_FALSE(r.monitor.empty());
  const auto& row = r.monitor.back().second;
  EXPECT_EQ(row.size(), 2u);
  EXPECT_TRUE(row.count("lr-SGD")) << "unnamed scheduler config: lr-<Optimizer>";
  EXPECT_TRUE(row.count("cosine")) << "named scheduler config: its name";
  EXPECT_EQ(row.at("cosine"), r.lrs[11][0]) << "at step 12: the lr step 12 used (set after step 11)";
}

TEST(LRSchedulers, MonitorNamesUnnamedSchedulersLikeLightning) {
  SchedRun r = FitScheduled("cosine_step", Options("sched_names"));
  ASSERT_FALSE(r.monitor.empty());
  const auto& row = r.monitor.front().second;
  EXPECT_EQ(row.size(), 2u);
  EXPECT_TRUE(row.count("lr-SGD"));
  EXPECT_TRUE(row.count("lr-SGD-1")) << "the second unnamed scheduler of the optimizer type";
}

// An uninterrupted run and one resumed from step=6.ckpt (mid epoch 1) give
// bit-identical lrs, momentums and losses from step 7 on.
void ExpectExactResume(const std::string& kind, const std::string& sdt, ClassifierConfig cc = {}) {
  SCOPED_TRACE(kind + " " + sdt);
  TrainerOptions o = Options("sched_resume_" + kind + "_" + sdt, sdt);
  o.checkpoint_every_n_steps = 6;
  SchedRun full = FitScheduled(kind, o, "", nullptr, cc);
  ASSERT_EQ(full.losses.size(), 12u);
  const std::string ckpt = full.ckpt_dir + "/step=6.ckpt";
  if (sdt == "sharded") {
    ASSERT_TRUE(IsDcpCheckpoint(ckpt));
    EXPECT_FALSE(OpenDcpCheckpoint(ckpt).meta.lr_schedulers.empty());
  } else {
    EXPECT_FALSE(LoadCheckpoint(ckpt).lr_schedulers.empty());
  }
  TrainerOptions o2 = Options("sched_resume_b_" + kind + "_" + sdt, sdt);
  SchedRun resumed = FitScheduled(kind, o2, ckpt, nullptr, cc);
  ASSERT_EQ(resumed.losses.size(), 6u);
  for (int64_t s = 7; s <= 12; ++s) {
    EXPECT_EQ(resumed.lrs[s], full.lrs[s]) << "lr after step " << s;
    EXPECT_EQ(resumed.momentums[s], full.momentums[s]) << "momentum after step " << s;
    EXPECT_EQ(resumed.losses[s - 7], full.losses[s - 1]) << "loss of step " << s;
  }
}

TEST(LRSchedulers, ResumeMidScheduleIsExactFullAndSharded) {
  for (const std::string sdt : {"full", "sharded"}) {
    ExpectExactResume("cosine_step", sdt);
    ClassifierConfig constant_val;
    constant_val.constant_val_loss = true;  // the plateau cuts the lr at the end of epochs 1 and 2
    ExpectExactResume("warmup_plateau", sdt, constant_val);
    ExpectExactResume("onecycle", sdt);
  }
}

TEST(LRSchedulers, PlateauCutsTheLrWhenValLossStalls) {
  ClassifierConfig constant_val;
  constant_val.constant_val_loss = true;
  SchedRun r = FitScheduled("warmup_plateau", Options("sched_plateau"), "", nullptr, constant_val);
  // Warmup: 0.025, then x(1 + 0.75/(0.75 + 0.25k)) per step to 0.1 at step 3, then cosine (T_max 20).
  // val_loss is 1.0 every epoch: epoch 0 sets best, epochs 1 and 2 are bad
  // (patience 0): x0.5 at their ends (seen from the next step on).
  auto cos_at = [](int64_t s) { return 0.1 * (1 + std::cos(M_PI * (s - 3) / 20.0)) / 2; };
  EXPECT_NEAR(r.lrs[1][0], 0.05, 1e-15);
  EXPECT_NEAR(r.lrs[3][0], 0.1, 1e-15);
  EXPECT_NEAR(r.lrs[5][0], cos_at(5), 1e-13) << "no cut after epoch 0 (its value is the first best)";
  EXPECT_NEAR(r.lrs[8][0], cos_at(8), 1e-13);
  EXPECT_NEAR(r.lrs[9][0], cos_at(9) * 0.5, 1e-13) << "cut after epoch 1";
  EXPECT_NEAR(r.lrs[12][0], cos_at(12) * 0.5, 1e-13);
}

TEST(LRSchedulers, PlateauOnAMissingMetricNamesItAndTheAvailableOnes) {
  try {
    FitScheduled("warmup_plateau", Options("sched_missing"), "", [](Scheduled& m) { m.monitor_ = "val_acc"; });
    FAIL() << "expected an error";
  } catch (const InvalidArgumentError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("conditioned on metric 'val_acc'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("available metrics: train_loss, val_loss"), std::string::npos) << msg;
  }
  // Not strict: the plateau's steps are skipped; the warmup and cosine go on.
  SchedRun r = FitScheduled("warmup_plateau", Options("sched_missing_lax"), "", [](Scheduled& m) {
    m.monitor_ = "val_acc";
    m.strict_ = false;
  });
  EXPECT_NEAR(r.lrs[12][0], 0.1 * (1 + std::cos(M_PI * 9 / 20.0)) / 2, 1e-13);
}

std::string FitError(const std::string& kind) {
  try {
    FitScheduled(kind, Options("sched_err_" + kind));
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "";
}

TEST(LRSchedulers, ConfigurationErrorsSayWhatIsValid) {
  std::string msg = FitError("other_optimizer");
  EXPECT_NE(msg.find("schedules an optimizer other than the one returned"), std::string::npos) << msg;
  EXPECT_NE(msg.find("one optimizer per module"), std::string::npos) << msg;
  msg = FitError("bad_interval");
  EXPECT_NE(msg.find("interval is 'batch'; valid: step, epoch"), std::string::npos) << msg;
}

TEST(LRSchedulers, ResumeWithOtherSchedulersIsAnError) {
  SchedRun a = FitScheduled("warmup_plateau", Options("sched_mismatch"));
  const std::string last = a.ckpt_dir + "/last.ckpt";
  auto resume_error = [&](const std::string& kind) -> std::string {
    try {
      FitScheduled(kind, Options("sched_mismatch_" + kind), last);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  std::string msg = resume_error("step_only");
  EXPECT_NE(msg.find("holds the state of 2 lr schedulers (SequentialLR, ReduceLROnPlateau) but configure_optimizers "
                     "returned 1 (StepLR); nothing was loaded"),
            std::string::npos)
      << msg;
  msg = resume_error("cosine_step");
  EXPECT_NE(msg.find("lr_schedulers[0] (StepLR): scheduler state is of SequentialLR, but this scheduler is a StepLR"),
            std::string::npos)
      << msg;
}

// A checkpoint of an lr_lambda run without "lr_schedulers" (as written before
// scheduler states were saved) resumes with the schedule replayed to its step.
TEST(LRSchedulers, LrLambdaResumesFromCheckpointsWithoutSchedulerState) {
  TrainerOptions o = Options("sched_legacy");
  o.checkpoint_every_n_steps = 6;
  FitResult full = Fit(2, o);  // fixtures' Classifier: lr_lambda 1 / (1 + 0.05 step)
  ASSERT_EQ(full.losses.size(), 12u);
  CheckpointData d = LoadCheckpoint(full.ckpt_dir + "/step=6.ckpt");
  ASSERT_EQ(d.lr_schedulers.size(), 1u);
  EXPECT_EQ(d.lr_schedulers[0].at("type"), "LambdaLR");
  d.lr_schedulers.clear();
  const std::string legacy = TmpDir("sched_legacy_ckpt") + "/legacy.ckpt";
  SaveCheckpoint(legacy, d);
  FitResult resumed = Fit(2, Options("sched_legacy_b"), legacy);
  ASSERT_EQ(resumed.losses.size(), 6u);
  for (int64_t s = 7; s <= 12; ++s) EXPECT_EQ(resumed.losses[s - 7], full.losses[s - 1]) << "loss of step " << s;
}

TEST(LRSchedulers, StateRoundTripContinuesExactly) {
  auto make = [] {
    return std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{at::zeros({2})}, torch::optim::SGDOptions(0.1));
  };
  auto o1 = make();
  auto seq1 = std::make_shared<SequentialLR>(
      o1, std::vector<LRSchedulerPtr>{std::make_shared<LinearLR>(o1, 0.1, 1.0, 4), std::make_shared<StepLR>(o1, 3)},
      std::vector<int64_t>{4});
  for (int i = 0; i < 6; ++i) seq1->step();
  auto o2 = make();
  auto seq2 = std::make_shared<SequentialLR>(
      o2, std::vector<LRSchedulerPtr>{std::make_shared<LinearLR>(o2, 0.1, 1.0, 4), std::make_shared<StepLR>(o2, 3)},
      std::vector<int64_t>{4});
  seq2->load_state_dict(seq1->state_dict());
  SetGroupLrs(*o2, GroupLrs(*o1));
  for (int i = 0; i < 8; ++i) {
    seq1->step();
    seq2->step();
    EXPECT_EQ(GroupLrs(*o1), GroupLrs(*o2)) << "step " << i;
  }
  auto plain = std::make_shared<StepLR>(make(), 3);
  EXPECT_THROW(plain->load_state_dict(seq1->state_dict()), InvalidArgumentError);
  EXPECT_THROW(plain->step(1.0), InvalidArgumentError);
}

}  // namespace
}  // namespace shardtrain::trainer
