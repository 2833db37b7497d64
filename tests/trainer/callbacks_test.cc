// Callbacks (ModelCheckpoint, LearningRateMonitor, EarlyStopping, a custom
// one) and the TensorBoard logger through the Trainer, threads-as-ranks.
#include "trainer/callbacks/callback.h"
#include "trainer/callbacks/early_stopping.h"
#include "trainer/callbacks/learning_rate_monitor.h"
#include "trainer/callbacks/model_checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "tests/trainer/fixtures.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/loggers/tensorboard_logger.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;

// One callback of type T per rank; `rank0` gets rank 0's.
template <typename T, typename Options>
MakeCallbacks PerRank(const Options& options, std::shared_ptr<T>& rank0) {
  return [&rank0, options](int rank) {
    auto cb = std::make_shared<T>(options);
    if (rank == 0) rank0 = cb;
    return std::vector<CallbackPtr>{cb};
  };
}

std::set<std::string> Files(const std::string& dir) {
  std::set<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

TEST(ModelCheckpoint, TopKByMonitoredMetricAndLast) {
  TrainerOptions o = BaseOptions(TmpDir("mc_topk"), 2);
  o.strategy = "ddp";
  o.max_epochs = 4;
  ModelCheckpointOptions mo;
  mo.monitor = "val_loss";
  mo.save_top_k = 2;
  mo.save_last = true;
  std::shared_ptr<ModelCheckpoint> mc;
  FitResult r = Fit(2, o, "", {}, nullptr, PerRank(mo, mc));
  ASSERT_EQ(r.val_losses.size(), 4u);
  // The two lowest validation losses are kept, with epoch, step and metric in the name.
  std::vector<std::pair<double, int>> by_loss;
  for (int e = 0; e < 4; ++e) by_loss.emplace_back(r.val_losses[e], e);
  std::sort(by_loss.begin(), by_loss.end());
  std::set<std::string> expected = {"last.ckpt"};
  for (int k = 0; k < 2; ++k) {
    const int e = by_loss[k].second;
    std::ostringstream name;
    name << "epoch=" << e << "-step=" << 4 * (e + 1) << "-val_loss=" << std::fixed << std::setprecision(4)
         << by_loss[k].first << ".ckpt";
    expected.insert(name.str());
  }
  EXPECT_EQ(Files(r.ckpt_dir), expected);
  EXPECT_EQ(mc->best_k_models().size(), 2u);
  EXPECT_EQ(mc->best_model_score(), by_loss[0].first);
  EXPECT_NE(mc->best_model_path().find("epoch=" + std::to_string(by_loss[0].second) + "-"), std::string::npos);
  EXPECT_EQ(mc->last_model_path(), (fs::path(r.ckpt_dir) / "last.ckpt").string());
  // last.ckpt is the end of training, with the callback's state.
  CheckpointData d = LoadCheckpoint(mc->last_model_path());
  EXPECT_EQ(d.global_step, 16);
  ASSERT_EQ(d.callbacks.count(mc->state_key()), 1u);
  EXPECT_EQ(d.callbacks.at(mc->state_key()).at("best_model_path"), mc->best_model_path());
}

TEST(ModelCheckpoint, EveryNTrainStepsKeepsAllWithoutMonitorAndReplacesBuiltin) {
  TrainerOptions o = BaseOptions(TmpDir("mc_steps"), 2);
  o.strategy = "fsdp_native";
  ModelCheckpointOptions mo;
  mo.every_n_train_steps = 5;
  mo.save_top_k = -1;
  std::shared_ptr<ModelCheckpoint> mc;
  FitResult r = Fit(2, o, "", {}, nullptr, PerRank(mo, mc));
  // No last.ckpt: a ModelCheckpoint callback replaces the built-in checkpointing.
  EXPECT_EQ(Files(r.ckpt_dir), (std::set<std::string>{"epoch=1-step=5.ckpt", "epoch=2-step=10.ckpt"}));
  CheckpointData d = LoadCheckpoint((fs::path(r.ckpt_dir) / "epoch=2-step=10.ckpt").string());
  EXPECT_EQ(d.global_step, 10);
  // Without a monitor the score is the step: the worst kept (Lightning's kth) is the earliest.
  EXPECT_TRUE(d.callbacks.at(mc->state_key()).at("kth_best_model_path") ==
              StateValue((fs::path(r.ckpt_dir) / "epoch=1-step=5.ckpt").string()));
}

TEST(ModelCheckpoint, MaxModeOnALoggedMetricWithShardedDirectories) {
  TrainerOptions o = BaseOptions(TmpDir("mc_max"), 2);
  o.strategy = "fsdp_native";
  o.strategy_options = {{"state_dict_type", "sharded"}};
  ModelCheckpointOptions mo;
  mo.monitor = "acc";
  mo.mode = "max";
  mo.every_n_train_steps = 2;
  mo.every_n_epochs = 0;
  mo.filename = "{step}-{acc:.3f}";
  std::shared_ptr<ModelCheckpoint> mc;
  ClassifierConfig c;
  c.log_accuracy = true;
  FitResult r = Fit(2, o, "", c, nullptr, PerRank(mo, mc));
  auto files = Files(r.ckpt_dir);
  ASSERT_EQ(files.size(), 1u);  // save_top_k = 1: the best so far replaces the others
  const std::string only = *files.begin();
  EXPECT_TRUE(std::regex_match(only, std::regex(R"(step=\d+-acc=\d\.\d{3}\.ckpt)"))) << only;
  EXPECT_TRUE(fs::is_directory(fs::path(r.ckpt_dir) / only));
  EXPECT_EQ(mc->best_model_path(), (fs::path(r.ckpt_dir) / only).string());
  EXPECT_GT(mc->best_model_score(), 0.5);
  EXPECT_TRUE(fs::exists(fs::path(mc->best_model_path()) / "__1_0.distcp"));  // one file per rank
  EXPECT_EQ(OpenDcpCheckpoint(mc->best_model_path()).meta.world_size, 2);
}

TEST(ModelCheckpoint, MissingMonitorAfterValidationIsAnError) {
  TrainerOptions o = BaseOptions(TmpDir("mc_missing"), 1);
  o.strategy = "single_device";
  ModelCheckpointOptions mo;
  mo.monitor = "val_acc";
  o.callbacks = {std::make_shared<ModelCheckpoint>(mo)};
  try {
    Fit(1, o);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("could not find the monitored metric; available: train_loss, val_loss"),
              std::string::npos)
        << e.what();
  }
  ModelCheckpointOptions bad;
  bad.mode = "best";
  EXPECT_THROW(ModelCheckpoint{bad}, InvalidArgumentError);
}

TEST(LearningRateMonitor, LogsEveryStepToTheLoggers) {
  TrainerOptions o = BaseOptions(TmpDir("lrm"), 2);
  o.strategy = "ddp";
  o.log_every_n_steps = 50;  // the trainer's own rows: none
  std::shared_ptr<LearningRateMonitor> lrm;
  FitResult r = Fit(2, o, "", {}, nullptr, PerRank(LearningRateMonitorOptions{}, lrm));
  ASSERT_EQ(lrm->history().size(), 12u);
  for (int s = 0; s < 12; ++s) {
    EXPECT_EQ(lrm->history()[s].first, s + 1);
    EXPECT_NEAR(lrm->history()[s].second.at("lr-Adam"), 2e-2 / (1.0 + 0.05 * s), 1e-12);
  }
  std::ifstream csv(fs::path(r.log_dir) / "metrics.csv");
  std::string header, line;
  std::getline(csv, header);
  EXPECT_NE(header.find("lr-Adam"), std::string::npos) << header;
  int rows = 0;
  while (std::getline(csv, line)) ++rows;
  EXPECT_EQ(rows, 12 + 3);  // the monitor's rows and the validation rows
  EXPECT_THROW(LearningRateMonitor(LearningRateMonitorOptions{"batch"}), InvalidArgumentError);
}

TEST(EarlyStopping, StopsAllRanksAfterPatience) {
  TrainerOptions o = BaseOptions(TmpDir("es"), 2);
  o.strategy = "fsdp_native";
  o.max_epochs = 10;
  EarlyStoppingOptions eo;
  eo.patience = 2;
  std::shared_ptr<EarlyStopping> es;
  ClassifierConfig c;
  c.constant_val_loss = true;  // never improves after the first validation
  std::vector<int64_t> steps(2, -1);
  FitResult r = Fit(
      2, o, "", c,
      [&](int rank, Trainer& t, Classifier&) {
        steps[rank] = t.global_step();
        EXPECT_TRUE(t.should_stop());
      },
      PerRank(eo, es));
  EXPECT_EQ(r.val_losses.size(), 3u);  // best, then two checks without improvement
  EXPECT_EQ(steps[0], 12);
  EXPECT_EQ(steps[1], 12);
  EXPECT_EQ(es->stopped_epoch(), 2);
  EXPECT_EQ(es->wait_count(), 2);
  EXPECT_NE(es->stop_reason().find("did not improve"), std::string::npos) << es->stop_reason();
  // The built-in last.ckpt holds the callback's counters, under Lightning's key and types.
  CheckpointData d = LoadCheckpoint(r.last_ckpt);
  EXPECT_EQ(es->state_key(), "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}");
  EXPECT_TRUE(d.callbacks.at(es->state_key()).at("wait_count") == StateValue(2));
  EXPECT_TRUE(d.callbacks.at(es->state_key()).at("best_score").is<ScoreTensor>());
}

// A stop requested on one rank only stops every rank after the same step.
class StopOnRank1 : public Callback {
 public:
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t) override {
    if (t.rank() == 1 && t.global_step() == 5) t.set_should_stop(true);
  }
};

TEST(Callbacks, StopRequestFromOneRankStopsAll) {
  TrainerOptions o = BaseOptions(TmpDir("stop1"), 2);
  o.strategy = "ddp";
  std::vector<int64_t> steps(2, -1);
  FitResult r = Fit(
      2, o, "", {}, [&](int rank, Trainer& t, Classifier&) { steps[rank] = t.global_step(); },
      [](int) { return std::vector<CallbackPtr>{std::make_shared<StopOnRank1>()}; });
  EXPECT_EQ(steps[0], 5);
  EXPECT_EQ(steps[1], 5);
  // The step after the request (run until its collective) was dropped: the
  // checkpoint resumes with it (step 5 = epoch 1's first batch).
  CheckpointData d = LoadCheckpoint(r.last_ckpt);
  EXPECT_EQ(d.global_step, 5);
  EXPECT_EQ(d.epoch, 1);
  EXPECT_EQ(d.batch_in_epoch, 1);
}

// Draws from the CPU generator at every micro-batch, on rank 0 only (the
// rank threads share the generator; it is reseeded once both ranks have
// built their models, whose initialization draws from it in any order).
class DrawOnRank0 : public Callback {
 public:
  void on_fit_start(Trainer& t, TrainingModule&) override {
    if (t.rank() == 0) at::manual_seed(7);
  }
  void on_train_batch_start(Trainer& t, TrainingModule&, const Batch&, int64_t) override {
    if (t.rank() == 0) at::rand({4});
  }
};

// The step dropped after a stop request also gives back its random draws:
// the checkpoint written at the stop holds the generator state of a run that
// simply ended after step 5.
TEST(Callbacks, StopRequestRestoresTheGeneratorOfTheDroppedStep) {
  TrainerOptions o = BaseOptions(TmpDir("stop_rng"), 2);
  o.strategy = "ddp";
  FitResult stopped = Fit(2, o, "", {}, nullptr, [](int) {
    return std::vector<CallbackPtr>{std::make_shared<DrawOnRank0>(), std::make_shared<StopOnRank1>()};
  });
  TrainerOptions ref_o = BaseOptions(TmpDir("stop_rng_ref"), 2);
  ref_o.strategy = "ddp";
  ref_o.max_steps = 5;
  FitResult ref = Fit(2, ref_o, "", {}, nullptr,
                      [](int) { return std::vector<CallbackPtr>{std::make_shared<DrawOnRank0>()}; });
  CheckpointData a = LoadCheckpoint(stopped.last_ckpt);
  CheckpointData b = LoadCheckpoint(ref.last_ckpt);
  EXPECT_EQ(a.global_step, 5);
  EXPECT_EQ(b.global_step, 5);
  ASSERT_TRUE(a.rng_state.defined() && b.rng_state.defined());
  EXPECT_TRUE(at::equal(a.rng_state, b.rng_state)) << "the dropped step's draws were kept";
  EXPECT_EQ(stopped.losses, ref.losses);
}

// Order and arguments of the hooks.
class Recorder : public Callback {
 public:
  void on_fit_start(Trainer&, TrainingModule&) override { events.push_back("fit_start"); }
  void on_fit_end(Trainer&, TrainingModule&) override { events.push_back("fit_end"); }
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor& loss, int64_t i) override {
    events.push_back("batch" + std::to_string(i) + "@" + std::to_string(t.global_step()));
  }
  void on_validation_end(Trainer& t, TrainingModule&) override {
    events.push_back("val@" + std::to_string(t.callback_metrics().count("val_loss")));
  }
  void on_train_epoch_end(Trainer& t, TrainingModule&, int64_t e) override {
    events.push_back("epoch" + std::to_string(e) + "@" + std::to_string(t.current_epoch()));
  }
  std::vector<std::string> events;
};

TEST(Callbacks, HookOrder) {
  TrainerOptions o = BaseOptions(TmpDir("order"), 1);
  o.strategy = "single_device";
  o.max_epochs = 1;
  o.accumulate_grad_batches = 2;
  auto rec = std::make_shared<Recorder>();
  o.callbacks = {rec};
  Fit(1, o);
  EXPECT_EQ(rec->events, (std::vector<std::string>{"fit_start", "batch0@0", "batch1@1", "batch2@1", "batch3@2",
                                                   "val@1", "epoch0@1", "fit_end"}));
}

// --- TensorBoard -----------------------------------------------------------------

// Reads TFRecords, checking both CRCs.
std::vector<std::string> ReadRecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  size_t off = 0;
  while (off < bytes.size()) {
    EXPECT_LE(off + 12, bytes.size());
    uint64_t len;
    uint32_t crc;
    std::memcpy(&len, bytes.data() + off, 8);
    std::memcpy(&crc, bytes.data() + off + 8, 4);
    EXPECT_EQ(crc, tensorboard::MaskedCrc32c(bytes.data() + off, 8));
    std::string data = bytes.substr(off + 12, len);
    std::memcpy(&crc, bytes.data() + off + 12 + len, 4);
    EXPECT_EQ(crc, tensorboard::MaskedCrc32c(data.data(), data.size()));
    out.push_back(data);
    off += 12 + len + 4;
  }
  return out;
}

TEST(TensorBoardLogger, Crc32cKnownValues) {
  // RFC 3720 test vector and the classic check value.
  EXPECT_EQ(tensorboard::Crc32c("123456789", 9), 0xE3069283u);
  std::string zeros(32, '\0');
  EXPECT_EQ(tensorboard::Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(TensorBoardLogger, TrainerWritesEventsNextToCsv) {
  TrainerOptions o = BaseOptions(TmpDir("tb"), 1);
  o.strategy = "single_device";
  o.loggers = {"csv", "tensorboard"};
  o.callbacks = {std::make_shared<LearningRateMonitor>()};
  FitResult r = Fit(1, o);
  std::string event_file;
  for (const auto& f : Files(r.log_dir)) {
    if (f.rfind("events.out.tfevents.", 0) == 0) event_file = (fs::path(r.log_dir) / f).string();
  }
  ASSERT_FALSE(event_file.empty()) << "no event file in " << r.log_dir;
  EXPECT_TRUE(fs::exists(fs::path(r.log_dir) / "metrics.csv"));
  EXPECT_TRUE(fs::exists(fs::path(r.log_dir) / "hparams.yaml"));
  auto recs = ReadRecords(event_file);
  ASSERT_GT(recs.size(), 12u);
  EXPECT_NE(recs[0].find("brain.Event:2"), std::string::npos);
  int train_loss = 0, lr = 0, val_loss = 0;
  for (const auto& r : recs) {
    train_loss += r.find("train_loss") != std::string::npos;
    lr += r.find("lr-Adam") != std::string::npos;
    val_loss += r.find("val_loss") != std::string::npos;
  }
  EXPECT_EQ(train_loss, 12);
  EXPECT_EQ(lr, 12);
  EXPECT_EQ(val_loss, 3);
  EXPECT_THROW(
      [] {
        TrainerOptions bad;
        bad.loggers = {"wandb"};
        Trainer t(bad);
      }(),
      InvalidArgumentError);
}

}  // namespace
}  // namespace shardtrain::trainer
