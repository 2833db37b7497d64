// The step, checkpoint and exception hooks of TrainingModule and Callback,
// TrainingModule::Log's options (epoch aggregation, sync_dist, reduce_fx,
// log_every_n_steps, prog_bar) and the one all-reduce per optimizer step,
// through the Trainer with threads-as-ranks (real Gloo).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "base/errors.h"
#include "tests/trainer/fixtures.h"
#include "trainer/callbacks/callback.h"
#include "trainer/callbacks/progress.h"
#include "trainer/checkpoint_io/checkpoint.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;

// ---- Hook order and arguments -------------------------------------------------

// A module and a callback that write every hook into one per-rank list.
class RecordingModule : public Classifier {
 public:
  explicit RecordingModule(std::vector<std::string>* events) : events_(events) {}
  at::Tensor training_step(const Batch& b, int64_t i) override {
    last_loss_ = Classifier::training_step(b, i);
    return last_loss_;
  }
  void on_train_batch_start(const Batch& b, int64_t i) override {
    events_->push_back("M:batch_start " + std::to_string(i) + " n=" + std::to_string(b.inputs.size(0)));
  }
  void on_before_backward(const at::Tensor& loss) override {
    // accumulate_grad_batches = 2: backward gets half the step's loss
    const bool half = at::allclose(loss, last_loss_ / 2.0);
    events_->push_back(std::string("M:before_backward ") + (half ? "loss/2" : "other"));
  }
  void on_after_backward() override { events_->push_back("M:after_backward"); }
  void on_train_batch_end(const at::Tensor&, int64_t i) override {
    events_->push_back("M:batch_end " + std::to_string(i));
  }
  void on_before_optimizer_step(torch::optim::Optimizer& opt) override {
    bool grads = true;
    for (const auto& p : strategy().parameters()) grads = grads && p.grad().defined();
    events_->push_back(std::string("M:before_optimizer_step @") + std::to_string(trainer().global_step()) +
                       (&opt == trainer().optimizer() ? " trainer's" : " other") + (grads ? " grads" : " no grads"));
  }
  void on_train_epoch_start(int64_t e) override { events_->push_back("M:epoch_start " + std::to_string(e)); }
  void on_train_epoch_end(int64_t e) override { events_->push_back("M:epoch_end " + std::to_string(e)); }
  void on_save_checkpoint(std::map<std::string, std::string>& c) override {
    events_->push_back("M:save_checkpoint");
    c["module_step"] = std::to_string(trainer().global_step());
  }
  void on_load_checkpoint(const std::map<std::string, std::string>& c) override {
    loaded = c;
    events_->push_back("M:load_checkpoint");
  }
  void on_exception(const std::exception& e) override { events_->push_back(std::string("M:exception ") + e.what()); }
  void on_fit_end() override { events_->push_back("M:fit_end"); }
  void on_model_wrapped() override {
    events_->push_back(std::string("M:model_wrapped ") + (strategy().has_sharded_state() ? "sharded" : "not sharded"));
  }
  std::map<std::string, std::string> loaded;

 private:
  std::vector<std::string>* events_;
  at::Tensor last_loss_;
};

class RecordingCallback : public Callback {
 public:
  explicit RecordingCallback(std::vector<std::string>* events) : events_(events) {}
  void on_train_batch_start(Trainer&, TrainingModule&, const Batch&, int64_t i) override {
    events_->push_back("C:batch_start " + std::to_string(i));
  }
  void on_before_backward(Trainer&, TrainingModule&, const at::Tensor&) override {
    events_->push_back("C:before_backward");
  }
  void on_after_backward(Trainer&, TrainingModule&) override { events_->push_back("C:after_backward"); }
  void on_before_optimizer_step(Trainer& t, TrainingModule&, torch::optim::Optimizer& opt) override {
    events_->push_back("C:before_optimizer_step @" + std::to_string(t.global_step()) +
                       (&opt == t.optimizer() ? " trainer's" : " other"));
  }
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t i) override {
    events_->push_back("C:batch_end " + std::to_string(i) + " @" + std::to_string(t.global_step()));
  }
  void on_train_epoch_start(Trainer&, TrainingModule&, int64_t e) override {
    events_->push_back("C:epoch_start " + std::to_string(e));
  }
  void on_train_epoch_end(Trainer&, TrainingModule&, int64_t e) override {
    events_->push_back("C:epoch_end " + std::to_string(e));
  }
  void on_save_checkpoint(Trainer& t, TrainingModule&, std::map<std::string, std::string>& c) override {
    events_->push_back("C:save_checkpoint sees module_step=" + c["module_step"]);
    c["callback"] = "cb@" + std::to_string(t.global_step());
  }
  void on_load_checkpoint(Trainer&, TrainingModule&, const std::map<std::string, std::string>& c) override {
    loaded = c;
    events_->push_back("C:load_checkpoint");
  }
  void on_exception(Trainer&, TrainingModule&, const std::exception& e) override {
    events_->push_back(std::string("C:exception ") + e.what());
  }
  void on_fit_end(Trainer&, TrainingModule&) override { events_->push_back("C:fit_end"); }
  std::map<std::string, std::string> loaded;

 private:
  std::vector<std::string>* events_;
};

TEST(Hooks, OrderAndArgumentsOnEveryRank) {
  // W=2, 4 micro-batches per rank, accumulate_grad_batches=2: 2 optimizer steps.
  TrainerOptions o = BaseOptions(TmpDir("hooks_order"), 2);
  o.strategy = "fsdp_native";
  o.max_epochs = 1;
  o.accumulate_grad_batches = 2;
  auto train = MakeData(64, 1);
  std::vector<std::vector<std::string>> events(2);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    RecordingModule module(&events[rank]);
    TrainerOptions mine = o;
    mine.callbacks = {std::make_shared<RecordingCallback>(&events[rank])};
    Trainer trainer(mine, comm);
    trainer.Fit(module, *train);
  });
  std::vector<std::string> expected = {"M:model_wrapped sharded", "M:epoch_start 0", "C:epoch_start 0"};
  for (int i = 0; i < 4; ++i) {
    const std::string n = std::to_string(i);
    for (const std::string& e :
         {"M:batch_start " + n + " n=8", "C:batch_start " + n, std::string("M:before_backward loss/2"),
          std::string("C:before_backward"), std::string("M:after_backward"), std::string("C:after_backward"),
          "M:batch_end " + n}) {
      expected.push_back(e);
    }
    if (i % 2 == 1) {
      const std::string step = std::to_string(i / 2);
      expected.push_back("M:before_optimizer_step @" + step + " trainer's grads");
      expected.push_back("C:before_optimizer_step @" + step + " trainer's");
    }
    expected.push_back("C:batch_end " + n + " @" + std::to_string((i + 1) / 2));
  }
  // Epoch end, then the built-in last.ckpt (module's extra state first), then the end of fit.
  for (const char* e : {"M:epoch_end 0", "C:epoch_end 0", "M:save_checkpoint",
                               "C:save_checkpoint sees module_step=2", "M:fit_end", "C:fit_end"}) {
    expected.push_back(e);
  }
  EXPECT_EQ(events[0], expected);
  EXPECT_EQ(events[1], expected);
}

// ---- on_save_checkpoint / on_load_checkpoint ----------------------------------

void ExtraStateRoundTrip(const std::string& dir, const strategies::StrategyOptions& strategy_options,
                         bool sharded) {
  TrainerOptions o = BaseOptions(TmpDir(dir), 2);
  o.strategy = "fsdp_native";
  o.strategy_options = strategy_options;
  o.max_epochs = 1;
  auto train = MakeData(64, 1);
  std::string last;
  std::vector<std::vector<std::string>> events(2);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    RecordingModule module(&events[rank]);
    TrainerOptions mine = o;
    mine.callbacks = {std::make_shared<RecordingCallback>(&events[rank])};
    Trainer trainer(mine, comm);
    trainer.Fit(module, *train);
    if (rank == 0) last = trainer.last_checkpoint_path();
  });
  ASSERT_FALSE(last.empty());
  EXPECT_EQ(fs::is_directory(last), sharded) << last;
  // Resume on fresh objects: both hooks read back what was written at step 4.
  const std::map<std::string, std::string> want = {{"module_step", "4"}, {"callback", "cb@4"}};
  std::vector<std::map<std::string, std::string>> module_loaded(2), callback_loaded(2);
  o.max_epochs = 2;
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    std::vector<std::string> ev;
    RecordingModule module(&ev);
    auto cb = std::make_shared<RecordingCallback>(&ev);
    TrainerOptions mine = o;
    mine.callbacks = {cb};
    Trainer trainer(mine, comm);
    trainer.Fit(module, *train, nullptr, last);
    module_loaded[rank] = module.loaded;
    callback_loaded[rank] = cb->loaded;
    ASSERT_GE(ev.size(), 3u);
    EXPECT_EQ(ev[0].rfind("M:model_wrapped ", 0), 0u) << ev[0];  // pretrained weights first, then the checkpoint
    EXPECT_EQ(ev[1], "M:load_checkpoint");                       // before the first batch
    EXPECT_EQ(ev[2], "C:load_checkpoint");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(module_loaded[r], want) << "rank " << r;
    EXPECT_EQ(callback_loaded[r], want) << "rank " << r;
  }
}

TEST(Hooks, CheckpointExtraStateRoundTripsThroughAFullCheckpoint) {
  ExtraStateRoundTrip("extra_full", {}, false);
}

TEST(Hooks, CheckpointExtraStateRoundTripsThroughAShardedCheckpoint) {
  ExtraStateRoundTrip("extra_sharded", {{"state_dict_type", "sharded"}}, true);
}

// ---- on_exception ------------------------------------------------------------------

class ThrowsAtBatch2 : public RecordingModule {
 public:
  using RecordingModule::RecordingModule;
  at::Tensor training_step(const Batch& b, int64_t i) override {
    if (i == 2) throw std::runtime_error("boom at batch 2");
    return RecordingModule::training_step(b, i);
  }
};

TEST(Hooks, OnExceptionSeesTheExceptionOnEveryRankBeforeItPropagates) {
  TrainerOptions o = BaseOptions(TmpDir("hooks_exc"), 2);
  o.strategy = "ddp";
  auto train = MakeData(64, 1);
  std::vector<std::vector<std::string>> events(2);
  std::vector<std::string> caught(2);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    ThrowsAtBatch2 module(&events[rank]);
    TrainerOptions mine = o;
    mine.callbacks = {std::make_shared<RecordingCallback>(&events[rank])};
    Trainer trainer(mine, comm);
    try {
      trainer.Fit(module, *train);
    } catch (const std::runtime_error& e) {
      caught[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(caught[r], "boom at batch 2");
    ASSERT_GE(events[r].size(), 2u);
    EXPECT_EQ(events[r][events[r].size() - 2], "M:exception boom at batch 2");
    EXPECT_EQ(events[r].back(), "C:exception boom at batch 2");
  }
}

// ---- Log ------------------------------------------------------------------------

// Logs x = 10 * rank + batch + 1 (and 100 - x) with every option; in
// validation 10 * rank + batch + 1 over 4 validation batches per rank.
class LoggingModule : public Classifier {
 public:
  at::Tensor training_step(const Batch& b, int64_t i) override {
    const double x = 10.0 * trainer().rank() + static_cast<double>(i) + 1.0;
    LogOptions epoch;
    epoch.on_epoch = true;
    epoch.on_step = false;
    auto with = [](LogOptions o, bool sync, const std::string& fx) {
      o.sync_dist = sync;
      o.reduce_fx = fx;
      return o;
    };
    Log("m", x, with(epoch, true, "mean"));
    Log("m0", x, with(epoch, false, "mean"));
    Log("s", x, with(epoch, true, "sum"));
    Log("s0", x, with(epoch, false, "sum"));
    Log("mx", x, with(epoch, true, "max"));
    Log("mx0", x, with(epoch, false, "max"));
    Log("mn", 100 - x, with(epoch, true, "min"));
    Log("mn0", 100 - x, with(epoch, false, "min"));
    LogOptions both;
    both.on_epoch = true;  // on_step defaults to true in training
    both.sync_dist = true;
    Log("b", x, both);
    LogOptions bar;
    bar.prog_bar = true;
    Log("p", x, bar);  // on_step only, rank 0's
    if (extra_on_rank1 && trainer().rank() == 1 && i == 1) Log("extra", 1.0);
    return Classifier::training_step(b, i);
  }
  std::optional<at::Tensor> validation_step(const Batch& b, int64_t i) override {
    const double x = 10.0 * trainer().rank() + static_cast<double>(i) + 1.0;
    LogOptions o;
    o.sync_dist = true;
    o.reduce_fx = "max";
    Log("vmax", x, o);
    log("v0", x);  // the shorthand: mean over the batches of all ranks
    LogOptions rank0;
    Log("vr0", x, rank0);  // mean of rank 0's batches
    return Classifier::validation_step(b, i);
  }
  bool extra_on_rank1 = false;
};

std::vector<std::map<std::string, std::string>> ReadCsv(const std::string& path) {
  std::ifstream in(path);
  std::string header, line;
  std::getline(in, header);
  std::vector<std::string> keys;
  std::stringstream hs(header);
  for (std::string k; std::getline(hs, k, ',');) keys.push_back(k);
  std::vector<std::map<std::string, std::string>> rows;
  while (std::getline(in, line)) {
    std::map<std::string, std::string> row;
    std::stringstream ls(line);
    std::string cell;
    for (size_t j = 0; j < keys.size() && std::getline(ls, cell, ','); ++j) {
      if (!cell.empty()) row[keys[j]] = cell;
    }
    rows.push_back(row);
  }
  return rows;
}

TEST(Log, EpochAggregatesStepValuesAndSyncDistAtTwoRanks) {
  TrainerOptions o = BaseOptions(TmpDir("log_epoch"), 2);
  o.strategy = "ddp";
  o.max_epochs = 1;     // 4 steps of one batch per rank
  o.log_every_n_steps = 2;
  o.val_batch_size = 2;  // 16 validation samples: 4 batches per rank
  auto train = MakeData(64, 1);
  auto val = MakeData(16, 2);
  std::string log_dir;
  std::vector<std::map<std::string, double>> metrics(2);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    LoggingModule module;
    Trainer trainer(o, comm);
    trainer.Fit(module, *train, val.get());
    metrics[rank] = trainer.callback_metrics();
    if (rank == 0) log_dir = trainer.log_dir();
  });
  auto rows = ReadCsv((fs::path(log_dir) / "metrics.csv").string());
  std::vector<std::map<std::string, std::string>> step_rows, epoch_rows, val_rows;
  for (const auto& r : rows) {
    if (r.count("train_loss")) step_rows.push_back(r);
    if (r.count("m")) epoch_rows.push_back(r);
    if (r.count("val_loss")) val_rows.push_back(r);
  }
  // log_every_n_steps=2: steps 2 and 4. p: rank 0's value; b_step: the rank mean (i+1 + 11+i) / 2.
  ASSERT_EQ(step_rows.size(), 2u);
  EXPECT_EQ(step_rows[0].at("step"), "2");
  EXPECT_EQ(step_rows[0].at("p"), "2");
  EXPECT_EQ(step_rows[0].at("b_step"), "7");
  EXPECT_EQ(step_rows[1].at("step"), "4");
  EXPECT_EQ(step_rows[1].at("p"), "4");
  EXPECT_EQ(step_rows[1].at("b_step"), "9");
  EXPECT_EQ(step_rows[0].count("b"), 0u);
  EXPECT_EQ(step_rows[0].count("m"), 0u);
  // The epoch row: rank 0 logged 1..4, rank 1 11..14.
  ASSERT_EQ(epoch_rows.size(), 1u);
  const auto& e = epoch_rows[0];
  EXPECT_EQ(e.at("step"), "4");
  EXPECT_EQ(e.at("epoch"), "0");
  EXPECT_EQ(e.at("m"), "7.5");     // mean over the 8 batches of both ranks
  EXPECT_EQ(e.at("m0"), "2.5");    // rank 0's mean
  EXPECT_EQ(e.at("s"), "60");
  EXPECT_EQ(e.at("s0"), "10");
  EXPECT_EQ(e.at("mx"), "14");
  EXPECT_EQ(e.at("mx0"), "4");
  EXPECT_EQ(e.at("mn"), "86");     // min of 100 - x
  EXPECT_EQ(e.at("mn0"), "96");
  EXPECT_EQ(e.at("b_epoch"), "7.5");
  EXPECT_EQ(e.count("b_step"), 0u);
  // Validation (4 batches per rank: rank 0 1..4, rank 1 11..14).
  ASSERT_EQ(val_rows.size(), 1u);
  EXPECT_EQ(val_rows[0].at("vmax"), "14");
  EXPECT_EQ(val_rows[0].at("v0"), "7.5");
  EXPECT_EQ(val_rows[0].at("vr0"), "2.5");
  // callback_metrics: the same agreed values on every rank.
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(metrics[r].at("m"), 7.5) << r;
    EXPECT_EQ(metrics[r].at("mx0"), 4) << r;
    EXPECT_EQ(metrics[r].at("b_step"), 9) << r;
    EXPECT_EQ(metrics[r].at("p"), 4) << r;
    EXPECT_EQ(metrics[r].at("vmax"), 14) << r;
  }
}

TEST(Log, DifferentNamesOnTheRanksAreAnErrorOnEveryRankNotAHang) {
  TrainerOptions o = BaseOptions(TmpDir("log_mismatch"), 2);
  o.strategy = "ddp";
  auto train = MakeData(64, 1);
  std::vector<std::string> errors(2);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    LoggingModule module;
    module.extra_on_rank1 = true;
    Trainer trainer(o, comm);
    try {
      trainer.Fit(module, *train);
    } catch (const InvalidArgumentError& e) {
      errors[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("the ranks logged different names in this step"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("extra (on_step) not logged by rank 0"), std::string::npos) << errors[r];
    EXPECT_EQ(errors[r].find("m (on_epoch)"), std::string::npos) << errors[r];  // logged by both
  }
  LoggingModule m;
  LogOptions median;
  median.reduce_fx = "median";
  EXPECT_THROW(m.Log("x", 1.0, median), InvalidArgumentError);
  LogOptions nothing;
  nothing.on_step = false;
  nothing.on_epoch = false;
  EXPECT_THROW(m.Log("x", 1.0, nothing), InvalidArgumentError);
}

TEST(Log, ProgressBarShowsTheProgBarMetrics) {
  ProgressReporter p(10, 1, stdout, /*tty=*/0);
  EXPECT_EQ(p.Format(0, 3, 0.5, 2.0, {{"acc", 0.75}, {"p", 3}}),
            "epoch 0 step 3/10 loss 0.5000 acc 0.7500 p 3.0000 2.00 it/s ETA 0:00:04");
}

// ---- One all-reduce per optimizer step, with callbacks too ---------------------

int64_t AllReducesOfFit(int64_t max_steps, bool with_callback) {
  TrainerOptions o = BaseOptions(TmpDir("count"), 2);
  o.strategy = "fsdp_native";
  o.enable_checkpointing = false;
  o.max_steps = max_steps;  // within the first epoch of 4 steps
  auto train = MakeData(64, 1);
  std::vector<int64_t> calls(2);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    ClassifierConfig c;
    c.log_accuracy = true;
    Classifier module(c);
    TrainerOptions mine = o;
    std::vector<std::string> ignored;
    if (with_callback) mine.callbacks = {std::make_shared<RecordingCallback>(&ignored)};
    Trainer trainer(mine, comm);
    trainer.Fit(module, *train);
    calls[rank] = comm->stats().Calls(comm::CommOp::kAllReduce);
  });
  EXPECT_EQ(calls[0], calls[1]);
  return calls[0];
}

TEST(Callbacks, OneAllReducePerStepWithAndWithoutCallbacks) {
  const int64_t one = AllReducesOfFit(1, false);
  const int64_t three = AllReducesOfFit(3, false);
  const int64_t three_cb = AllReducesOfFit(3, true);
  EXPECT_EQ(three - one, 2);  // steps 2 and 3: one each (step 1 also sends the logged names' layout)
  EXPECT_EQ(three_cb, three);
}

}  // namespace
}  // namespace shardtrain::trainer
