// Trainer end to end on CPU, threads-as-ranks over Gloo (injected communicator).
#include "trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdlib>
#include <functional>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "sharding/wrap_point.h"
#include "tests/testing/multi_rank.h"
#include "tests/trainer/fixtures.h"
#include "trainer/callbacks/progress.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/resume.h"
#include "trainer/data/data.h"
#include "trainer/loggers/csv_logger.h"

namespace shardtrain::trainer {
namespace {
namespace fs = std::filesystem;
using shardtrain::testing::RunRanks;

using fixtures::Classifier;
using fixtures::FitResult;
using fixtures::MakeData;
using fixtures::TmpDir;

// fixtures::Fit with the default classifier, checking that every rank's
// module saw on_fit_start exactly once.
FitResult Fit(int world, const TrainerOptions& o, const std::string& ckpt_path = "") {
  return fixtures::Fit(world, o, ckpt_path, {},
                       [](int, Trainer&, Classifier& module) { EXPECT_EQ(module.fit_starts, 1); });
}

TrainerOptions BaseOptions(const std::string& root) {
  TrainerOptions o;
  o.default_root_dir = root;
  o.max_epochs = 3;
  o.batch_size = 8;
  o.log_every_n_steps = 2;
  o.enable_progress_bar = false;
  o.seed = 3;
  return o;
}

// The choice lists the example flags offer come from the tables the Trainer
// parses with: every listed value is accepted, and what is not listed is not.
TEST(Trainer, ChoiceTablesAreWhatTheTrainerAccepts) {
  auto accepted = [](const std::function<void(TrainerOptions&)>& set) {
    TrainerOptions o;
    set(o);
    try {
      Trainer t(o);
      return true;
    } catch (const InvalidArgumentError&) {
      return false;
    }
  };
  for (const auto& v : NonfiniteModes()) EXPECT_TRUE(accepted([&](TrainerOptions& o) { o.nonfinite = v; })) << v;
  for (const auto& v : ResumeModes()) EXPECT_TRUE(accepted([&](TrainerOptions& o) { o.resume = v; })) << v;
  for (const auto& v : ProfilerNames()) EXPECT_TRUE(accepted([&](TrainerOptions& o) { o.profiler = v; })) << v;
  for (const auto& v : strategies::PrecisionNames()) {
    EXPECT_TRUE(accepted([&](TrainerOptions& o) { o.precision = v; })) << v;
  }
  EXPECT_EQ(AcceleratorNames(), (std::vector<std::string>{"cpu", "cuda", "gpu", "auto"}));
  EXPECT_FALSE(accepted([](TrainerOptions& o) { o.nonfinite = "warn"; }));
  EXPECT_FALSE(accepted([](TrainerOptions& o) { o.resume = "always"; }));
  EXPECT_FALSE(accepted([](TrainerOptions& o) { o.profiler = "advanced"; }));
  EXPECT_FALSE(accepted([](TrainerOptions& o) { o.precision = "64-true"; }));
}

TEST(Trainer, EveryStrategyLearns) {
  for (const std::string name : {"ddp", "fsdp", "ddp_fully_sharded", "fsdp_native", "fsdp_native_full_shard_offload",
                                 "single_device"}) {
    SCOPED_TRACE(name);
    TrainerOptions o = BaseOptions(TmpDir("learn_" + name));
    o.strategy = name;
    o.accumulate_grad_batches = 2;
    o.gradient_clip_val = 1.0;
    const int world = name == "single_device" ? 1 : 2;
    FitResult r = Fit(world, o);
    ASSERT_FALSE(r.losses.empty());
    EXPECT_LT(r.losses.back(), r.losses.front() * 0.9);
    ASSERT_EQ(r.val_losses.size(), 3u);
    EXPECT_LT(r.val_losses.back(), r.val_losses.front());
  }
}

TEST(Trainer, ResumeContinuesExactly) {
  for (const std::string name : {"fsdp_native", "ddp"}) {
    SCOPED_TRACE(name);
    TrainerOptions o = BaseOptions(TmpDir("resume_full_" + name));
    o.strategy = name;
    FitResult full = Fit(2, o);
    ASSERT_EQ(full.losses.size(), 12u);  // 64 samples / 2 ranks / batch 8 = 4 steps per epoch
    TrainerOptions first = BaseOptions(TmpDir("resume_a_" + name));
    first.strategy = name;
    first.max_steps = 6;  // stops in the middle of epoch 1
    FitResult a = Fit(2, first);
    ASSERT_EQ(a.losses.size(), 6u);
    ASSERT_TRUE(fs::exists(a.last_ckpt)) << a.last_ckpt;
    TrainerOptions second = BaseOptions(TmpDir("resume_b_" + name));
    second.strategy = name;
    FitResult b = Fit(2, second, a.last_ckpt);
    ASSERT_EQ(b.losses.size(), 6u);
    for (size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(a.losses[i], full.losses[i]) << "step " << i;
      EXPECT_NEAR(b.losses[i], full.losses[6 + i], 1e-6) << "step " << 6 + i;
    }
  }
}

TEST(Checkpoint, FitWritesItsStateAndATruncatedCopyFailsClearly) {
  TrainerOptions o = BaseOptions(TmpDir("ckpt"));
  o.strategy = "fsdp";
  o.max_epochs = 1;
  FitResult r = Fit(2, o);
  CheckpointData d = LoadCheckpoint(r.last_ckpt);
  EXPECT_EQ(d.global_step, 4);
  EXPECT_EQ(d.epoch, 1);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.strategy, "fsdp");
  EXPECT_TRUE(d.optimizer_states.empty()) << "Adam state is stored once, as torch.optim's (optimizer_states)";
  EXPECT_EQ(d.optimizer_full.kind, "Adam");
  EXPECT_EQ(d.hparams.at("model"), "mlp");
  // The optimizer's one group holds every parameter, in the module's order (what Python's parameters() gives).
  ASSERT_EQ(d.optimizer_groups.size(), 1u);
  EXPECT_EQ(d.optimizer_groups[0].params, (std::vector<std::string>{"b1.fc.weight", "b1.fc.bias", "b2.fc.weight",
                                                                     "b2.fc.bias", "head.weight", "head.bias"}));
  EXPECT_EQ(d.state_dict.count("b1.fc.weight"), 1u);
  EXPECT_EQ(d.state_dict.at("b1.fc.weight").sizes(), (std::vector<int64_t>{16, 8}));
  // No temporary files are left next to it.
  for (const auto& e : fs::directory_iterator(fs::path(r.last_ckpt).parent_path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  // Truncated copy: a clear error, from LoadCheckpoint and from Fit.
  const std::string bad = (fs::path(TmpDir("ckpt_bad")) / "bad.ckpt").string();
  {
    std::ifstream in(r.last_ckpt, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream out(bad, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  try {
    LoadCheckpoint(bad);
    ADD_FAILURE() << "no error for a truncated checkpoint";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated or corrupt"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Fit(2, o, bad), Error);
  EXPECT_THROW(LoadCheckpoint(bad + ".missing"), Error);
}

// Each CUDA device's generator state travels in "cuda_rng_states" (written
// where devices are visible, so a CUDA run resumes its dropout draws): the
// format keeps the list, and a resume where there is no CUDA reads such a
// file and goes on.
TEST(Checkpoint, CudaGeneratorStatesRoundTripAndResumeWithoutCuda) {
  TrainerOptions o = BaseOptions(TmpDir("ckpt_cuda_rng"));
  o.strategy = "ddp";
  o.max_steps = 2;
  FitResult r = Fit(2, o);
  CheckpointData d = LoadCheckpoint(r.last_ckpt);
  EXPECT_EQ(d.cuda_rng_states.size(), at::hasCUDA() ? at::getNumGPUs() : size_t{0});
  d.cuda_rng_states = {at::arange(16, at::kByte), at::arange(8, at::kByte) * 3};
  const std::string path = (fs::path(TmpDir("ckpt_cuda_rng_b")) / "with_cuda.ckpt").string();
  SaveCheckpoint(path, d);
  CheckpointData back = LoadCheckpoint(path);
  ASSERT_EQ(back.cuda_rng_states.size(), 2u);
  EXPECT_TRUE(at::equal(back.cuda_rng_states[0], d.cuda_rng_states[0]));
  EXPECT_TRUE(at::equal(back.cuda_rng_states[1], d.cuda_rng_states[1]));
  if (at::hasCUDA()) GTEST_SKIP() << "skipped: the resume half needs a machine without CUDA (these states are fake)";
  TrainerOptions resume = BaseOptions(TmpDir("ckpt_cuda_rng_c"));
  resume.strategy = "ddp";
  resume.max_steps = 3;
  EXPECT_EQ(Fit(2, resume, path).losses.size(), 1u);
}

// An optimizer "optimizer_full" cannot hold (RMSprop) is saved as the
// per-rank LibTorch archives: the file resumes exactly at the same world
// size, and at another one fails naming both world sizes.
TEST(Checkpoint, OtherOptimizersKeepPerRankArchivesAndResumeAtTheSameWorldSize) {
  fixtures::ClassifierConfig c;
  c.optimizer = "rmsprop";
  TrainerOptions o = BaseOptions(TmpDir("rms_full"));
  o.strategy = "fsdp";
  o.max_epochs = 2;
  FitResult full = fixtures::Fit(2, o, "", c);
  TrainerOptions first = BaseOptions(TmpDir("rms_a"));
  first.strategy = "fsdp";
  first.max_steps = 6;
  FitResult a = fixtures::Fit(2, first, "", c);
  CheckpointData d = LoadCheckpoint(a.last_ckpt);
  EXPECT_EQ(d.optimizer_states.size(), 2u);
  EXPECT_TRUE(d.optimizer_full.empty());
  TrainerOptions second = BaseOptions(TmpDir("rms_b"));
  second.strategy = "fsdp";
  second.max_epochs = 2;
  FitResult b = fixtures::Fit(2, second, a.last_ckpt, c);
  ASSERT_EQ(b.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(b.losses[i], full.losses[6 + i], 1e-6) << "step " << 6 + i;
  try {
    fixtures::Fit(1, BaseOptions(TmpDir("rms_c")), a.last_ckpt, c);
    ADD_FAILURE() << "no error resuming RMSprop archives of 2 ranks at world size 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer state of 2 ranks"), std::string::npos) << e.what();
  }
}

TEST(CsvLogger, LightningLayout) {
  const std::string root = TmpDir("csv");
  {
    CsvLogger a(root, "lightning_logs");
    EXPECT_EQ(a.version(), 0);
    a.LogHyperparams({{"lr", "0.1"}, {"name", "a: b"}});
    a.LogMetrics({{"train_loss", 1.5}, {"epoch", 0}}, 1);
    a.LogMetrics({{"val_loss", 0.25}, {"epoch", 0}}, 2);
    a.Save();
  }
  CsvLogger b(root, "lightning_logs");
  EXPECT_EQ(b.version(), 1);
  std::ifstream csv(fs::path(root) / "lightning_logs" / "version_0" / "metrics.csv");
  std::stringstream ss;
  ss << csv.rdbuf();
  EXPECT_EQ(ss.str(), "epoch,step,train_loss,val_loss\n0,1,1.5,\n0,2,,0.25\n");
  std::ifstream hp(fs::path(root) / "lightning_logs" / "version_0" / "hparams.yaml");
  std::stringstream hs;
  hs << hp.rdbuf();
  EXPECT_EQ(hs.str(), "lr: 0.1\nname: 'a: b'\n");
}

TEST(Trainer, WritesLogsAndCheckpointsInLightningLayout) {
  const std::string root = TmpDir("layout");
  TrainerOptions o = BaseOptions(root);
  o.max_epochs = 1;
  o.strategy = "single_device";
  FitResult r = Fit(1, o);
  EXPECT_EQ(r.log_dir, (fs::path(root) / "lightning_logs" / "version_0").string());
  EXPECT_TRUE(fs::exists(fs::path(r.log_dir) / "metrics.csv"));
  EXPECT_TRUE(fs::exists(fs::path(r.log_dir) / "hparams.yaml"));
  EXPECT_EQ(r.last_ckpt, (fs::path(r.log_dir) / "checkpoints" / "last.ckpt").string());
  std::ifstream csv(fs::path(r.log_dir) / "metrics.csv");
  std::string header;
  std::getline(csv, header);
  EXPECT_EQ(header, "epoch,lr,step,train_loss,val_loss");
}

TEST(Trainer, OptionErrors) {
  // The constructor and CheckTrainerOptions (what a program calls on options
  // read from flags or a file) refuse the same options with the same words.
  auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const InvalidArgumentError& e) {
      return e.what();
    }
    return "";
  };
  auto msg = [&](const TrainerOptions& o) {
    const std::string from_constructor = error_of([&] { Trainer t(o); });
    EXPECT_EQ(error_of([&] { CheckTrainerOptions(o); }), from_constructor);
    return from_constructor;
  };
  EXPECT_EQ(msg({}), "");
  TrainerOptions o;
  o.precision = "8-true";
  EXPECT_NE(msg(o).find("valid: 32-true, bf16-mixed, 16-mixed, bf16-true"), std::string::npos);
  o = {};
  o.strategy = "deepspeed";
  EXPECT_NE(msg(o).find("unknown strategy 'deepspeed'"), std::string::npos);
  o = {};
  o.strategy = "fsdp";
  o.strategy_options = {{"flatten_parameters", "false"}};
  EXPECT_NE(msg(o).find("flatten_parameters=false is not supported"), std::string::npos);
  o = {};
  o.gradient_clip_algorithm = "l1";
  EXPECT_NE(msg(o).find("valid: norm, value"), std::string::npos);
  o = {};
  o.accelerator = "tpu";
  EXPECT_NE(msg(o).find("unknown accelerator 'tpu'; valid: cpu, cuda, gpu (= cuda), auto"), std::string::npos);
  // Sharded strategies refuse bf16-true at construction and name bf16-mixed.
  o = {};
  o.strategy = "fsdp_native";
  o.precision = "bf16-true";
  EXPECT_NE(msg(o).find("Use precision 'bf16-mixed'"), std::string::npos) << msg(o);
  o = {};
  o.max_epochs = -2;
  EXPECT_NE(msg(o).find("max_epochs must be >= 0, -1 (unlimited) or unset, got -2"), std::string::npos) << msg(o);
  o = {};
  o.max_epochs = -1;
  EXPECT_NE(msg(o).find("max_epochs=-1 (unlimited) needs max_steps"), std::string::npos) << msg(o);
  o.max_steps = 5;
  EXPECT_EQ(msg(o), "");
  o = {};
  o.nonfinite = "warn";
  EXPECT_NE(msg(o).find("warn"), std::string::npos) << msg(o);
  o = {};
  o.resume = "always";
  EXPECT_NE(msg(o).find("resume must be"), std::string::npos) << msg(o);
  o = {};
  o.num_workers = -1;
  EXPECT_NE(msg(o).find("num_workers"), std::string::npos) << msg(o);
  o = {};
  o.async_checkpoint_max_extra_memory = 1.5;
  EXPECT_NE(
      msg(o).find("async_checkpoint_max_extra_memory must be in [0, 1] (a fraction of what a rank writes), got 1.5"),
      std::string::npos)
      << msg(o);
  o = {};
  o.strategy_options = {{"sharding_strategy", "FULL_SHARD"}};  // strategy "auto"
  EXPECT_NE(msg(o).find("strategy 'auto' takes no options"), std::string::npos) << msg(o);
}

// Lightning's rule for an unset max_epochs: 1000 without max_steps; with
// max_steps alone, max_steps decides (not one epoch).
TEST(Trainer, UnsetMaxEpochsFollowsLightning) {
  TrainerOptions o;
  EXPECT_EQ(Trainer(o).max_epochs(), kDefaultMaxEpochs);
  EXPECT_EQ(kDefaultMaxEpochs, 1000);
  o.max_steps = 10;
  EXPECT_EQ(Trainer(o).max_epochs(), -1);
  o.max_epochs = 2;
  EXPECT_EQ(Trainer(o).max_epochs(), 2);
  TrainerOptions run = BaseOptions(TmpDir("max_steps_only"));
  run.max_epochs.reset();
  run.max_steps = 10;  // 4 steps per epoch at W=2: ends in the middle of the third epoch
  run.strategy = "ddp";
  FitResult r = Fit(2, run);
  EXPECT_EQ(r.losses.size(), 10u);
  EXPECT_EQ(r.global_step, 10);
  EXPECT_EQ(r.epoch, 2);
}

// An optimizer over tensors the strategy does not train (here the module's
// own parameters, which sharded strategies replace by shards) stops Fit
// with a message that says how many and what to do.
TEST(Trainer, OptimizerOverForeignTensorsIsAnError) {
  TrainerOptions o = BaseOptions(TmpDir("foreign_opt"));
  o.strategy = "fsdp";
  fixtures::ClassifierConfig c;
  c.optimizer_over_module_parameters = true;
  try {
    fixtures::Fit(2, o, "", c);
    ADD_FAILURE() << "no error for an optimizer over the module's own parameters under fsdp";
  } catch (const InvalidArgumentError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("configure_optimizers returned an optimizer over 6 of 6 tensor(s) that strategy 'fsdp' "
                       "does not train"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("Build the optimizer from the `params` handed to configure_optimizers"), std::string::npos)
        << msg;
  }
  // Replicated strategies train the module's own tensors: the same module is fine there.
  TrainerOptions single = BaseOptions(TmpDir("own_opt"));
  single.strategy = "single_device";
  single.max_epochs = 1;
  EXPECT_EQ(fixtures::Fit(1, single, "", c).losses.size(), 8u);
}

TEST(Data, DistributedSamplerSharesEvenly) {
  for (bool drop_last : {false, true}) {
    std::multiset<int64_t> seen;
    int64_t per = -1;
    for (int r = 0; r < 3; ++r) {
      DistributedSampler s(10, 3, r, true, 5, drop_last);
      s.set_epoch(1);
      auto idx = s.indices();
      if (per < 0) per = static_cast<int64_t>(idx.size());
      EXPECT_EQ(static_cast<int64_t>(idx.size()), per);
      seen.insert(idx.begin(), idx.end());
    }
    EXPECT_EQ(per, drop_last ? 3 : 4);
    std::set<int64_t> distinct(seen.begin(), seen.end());
    EXPECT_EQ(distinct.size(), drop_last ? 9u : 10u);
  }
  DistributedSampler s(10, 2, 0, true, 5, false);
  auto e0 = s.indices();
  s.set_epoch(1);
  EXPECT_NE(s.indices(), e0);
  s.set_epoch(0);
  EXPECT_EQ(s.indices(), e0);
  auto batches = MakeBatches({1, 2, 3, 4, 5}, 2, false);
  EXPECT_EQ(batches.size(), 3u);
  EXPECT_EQ(MakeBatches({1, 2, 3, 4, 5}, 2, true).size(), 2u);
}

TEST(Progress, PlainLine) {
  ProgressReporter p(100, 10, stdout, /*tty=*/0);
  EXPECT_EQ(p.Format(1, 50, 0.5, 10.0), "epoch 1 step 50/100 loss 0.5000 10.00 it/s ETA 0:00:05");
}

}  // namespace
}  // namespace shardtrain::trainer
