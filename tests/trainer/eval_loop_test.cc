// Trainer::Test and Trainer::Predict (trainer/loops/eval_loop.cc), threads-as-ranks
// over Gloo: test metrics at W=1, 2, 3 equal the single-process computation
// over the whole set (padding duplicates not counted), predictions come back
// once per sample in dataset order, both use the fitted (sharded) model, and
// the test / validation epoch-end hooks see the reduced metrics.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "base/errors.h"
#include "sharding/wrap_point.h"
#include "tests/testing/multi_rank.h"
#include "tests/trainer/fixtures.h"
#include "trainer/loggers/logger.h"
#include "trainer/trainer.h"
#include "trainer/training_module.h"

namespace shardtrain::trainer {
namespace {
using shardtrain::testing::RunRanks;

// Elementwise layers only: a sample's output does not depend on which other
// samples share its batch, so any batching gives bit-identical rows.
// Weights drawn from `g` inside the constructor (sharded construction keeps
// only this rank's shard once the wrap point is built).
class ScaleImpl : public torch::nn::Module {
 public:
  explicit ScaleImpl(at::Generator& g) { w = register_parameter("w", at::randn({8}, g)); }
  at::Tensor forward(const at::Tensor& x) { return x * w; }
  at::Tensor w;
};

class ScaleNetImpl : public torch::nn::Module {
 public:
  explicit ScaleNetImpl(at::Generator& g) {
    a = register_module("a", std::make_shared<sharding::Sharded<ScaleImpl>>(g));
    b = register_module("b", std::make_shared<sharding::Sharded<ScaleImpl>>(g));
    drop = register_module("drop", torch::nn::Dropout(0.5));  // eval mode must turn it off
  }
  at::Tensor forward(const at::Tensor& x) { return b->forward(drop->forward(a->forward(x))) + 0.1; }
  std::shared_ptr<sharding::Sharded<ScaleImpl>> a, b;
  torch::nn::Dropout drop{nullptr};
};

std::shared_ptr<ScaleNetImpl> MakeNet() {
  auto g = at::detail::createCPUGenerator(7);  // threads-as-ranks share the global generator
  return std::make_shared<ScaleNetImpl>(g);
}

// Per-sample cross entropy over the first three outputs, and correctness, in float64.
at::Tensor SampleLoss(const at::Tensor& out, const at::Tensor& y) {
  return at::cross_entropy_loss(out.to(at::kDouble).slice(1, 0, 3), y, {}, at::Reduction::None);
}
at::Tensor SampleHit(const at::Tensor& out, const at::Tensor& y) {
  return out.slice(1, 0, 3).argmax(1).eq(y).to(at::kDouble);
}

class ScaleModule : public TrainingModule {
 public:
  std::shared_ptr<torch::nn::Module> configure_model() override { return net = MakeNet(); }
  at::Tensor training_step(const Batch& b, int64_t) override {
    return at::cross_entropy_loss(forward([&] { return net->forward(b.inputs); }).slice(1, 0, 3), b.targets);
  }
  std::optional<at::Tensor> validation_step(const Batch& b, int64_t) override {
    return SampleLoss(forward([&] { return net->forward(b.inputs); }), b.targets).mean();
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    return {std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(5e-2))};
  }
  std::optional<at::Tensor> test_step(const Batch& b, int64_t) override {
    at::Tensor out = forward([&] { return net->forward(b.inputs); });
    log("test_acc", SampleHit(out, b.targets).mean().item<double>());
    test_rows += b.inputs.size(0);
    return SampleLoss(out, b.targets).mean();
  }
  at::Tensor predict_step(const Batch& b, int64_t) override { return forward([&] { return net->forward(b.inputs); }); }
  void on_test_start() override { hooks.push_back("on_test_start"); }
  void on_test_epoch_end() override {
    hooks.push_back("on_test_epoch_end");
    seen_in_epoch_end = trainer().callback_metrics();
    log("rank_mean", trainer().rank());  // rank-averaged into the metrics
  }
  void on_test_end() override { hooks.push_back("on_test_end"); }
  void on_validation_epoch_end() override {
    hooks.push_back("on_validation_epoch_end");
    val_loss_in_epoch_end.push_back(trainer().callback_metrics().at("val_loss"));
  }

  std::shared_ptr<ScaleNetImpl> net;
  std::vector<std::string> hooks;
  std::map<std::string, double> seen_in_epoch_end;
  std::vector<double> val_loss_in_epoch_end;
  int64_t test_rows = 0;
};

class RecordingCallback : public Callback {
 public:
  void on_test_start(Trainer&, TrainingModule&) override { hooks.push_back("cb_on_test_start"); }
  void on_test_epoch_end(Trainer& t, TrainingModule&) override {
    hooks.push_back("cb_on_test_epoch_end");
    test_loss = t.callback_metrics().at("test_loss");
  }
  void on_test_end(Trainer&, TrainingModule&) override { hooks.push_back("cb_on_test_end"); }
  void on_validation_epoch_end(Trainer&, TrainingModule&) override { ++val_epoch_ends; }
  std::vector<std::string> hooks;
  double test_loss = 0;
  int val_epoch_ends = 0;
};

class RowLogger : public Logger {
 public:
  const std::string& log_dir() const override { return dir_; }
  void LogHyperparams(const std::map<std::string, std::string>&) override {}
  void LogMetrics(const std::map<std::string, double>& m, int64_t step) override { rows.emplace_back(step, m); }
  std::vector<std::pair<int64_t, std::map<std::string, double>>> rows;

 private:
  std::string dir_ = "";
};

TensorDataset MakeSet(int64_t n) {
  auto g = at::detail::createCPUGenerator(11);
  at::Tensor x = at::randn({n, 8}, g);
  return TensorDataset(x, at::randint(0, 3, {n}, g));
}

TrainerOptions EvalOptions(const std::string& strategy, int64_t batch) {
  TrainerOptions o;
  o.strategy = strategy;
  o.default_root_dir = "eval_loop_unused";  // nothing is written: no logger, no checkpoints
  o.enable_logger = false;
  o.enable_progress_bar = false;
  o.enable_checkpointing = false;
  o.batch_size = batch;
  return o;
}

struct Reference {
  double loss = 0, acc = 0;
  at::Tensor out;
};

// The single-process computation over the whole set at once.
Reference Compute(ScaleNetImpl& net, const TensorDataset& data) {
  net.eval();
  at::NoGradGuard no_grad;
  Batch all = data.get_batch([&] {
    std::vector<int64_t> idx(data.size());
    for (int64_t i = 0; i < data.size(); ++i) idx[i] = i;
    return idx;
  }());
  Reference r;
  r.out = net.forward(all.inputs);
  r.loss = SampleLoss(r.out, all.targets).mean().item<double>();
  r.acc = SampleHit(r.out, all.targets).mean().item<double>();
  return r;
}

// 25 samples: at W=2 and W=3 the sampler pads; with batch 4 a padded rank's
// last batch is nothing but padding (runs whole, counts nothing), with batch 3
// it holds real samples and one duplicate (cut).
// A value log()ged after a step's metrics were collected (here in a
// callback's on_train_batch_end) joins the next step's row, also when a
// validation pass runs in between: the pass sets the module's pending values
// aside and puts them back (eval_loop.cc, LogStash).
TEST(TrainerTest, ValueLoggedBeforeValidationJoinsTheNextStepsRow) {
  struct LogAfterStep : Callback {
    std::vector<double> seen;  // callback_metrics()["after_step"] at each step's end, -1 when absent
    void on_train_batch_end(Trainer& t, TrainingModule& m, const at::Tensor&, int64_t i) override {
      const auto it = t.callback_metrics().find("after_step");
      seen.push_back(it == t.callback_metrics().end() ? -1 : it->second);
      m.log("after_step", static_cast<double>(i + 1));
    }
  };
  auto cb = std::make_shared<LogAfterStep>();
  TrainerOptions o = fixtures::BaseOptions(fixtures::TmpDir("log_stash"), 1);
  o.max_epochs = 1;
  o.val_check_interval = 2;  // validation after batches 2 and 4 (of 4)
  o.callbacks = {cb};
  fixtures::Classifier module;
  Trainer trainer(o);
  const auto train = fixtures::MakeData(64, 1), val = fixtures::MakeData(16, 2);
  trainer.Fit(module, *train, val.get());
  EXPECT_EQ(cb->seen, (std::vector<double>{-1, 1, 2, 3}));
}

TEST(TrainerTest, TestMetricsEqualTheSingleProcessComputation) {
  const TensorDataset data = MakeSet(25);
  auto ref_net = MakeNet();
  const Reference ref = Compute(*ref_net, data);
  for (int world : {1, 2, 3}) {
    for (int64_t batch : {3, 4}) {
      SCOPED_TRACE("W=" + std::to_string(world) + " batch=" + std::to_string(batch));
      std::mutex mu;
      std::vector<std::map<std::string, double>> metrics(world);
      RunRanks(world, [&](int rank, const auto& comm) {
        TrainerOptions o = EvalOptions(world == 1 ? "single_device" : "fsdp_native", batch);
        auto cb = std::make_shared<RecordingCallback>();
        auto logger = std::make_shared<RowLogger>();
        o.callbacks = {cb};
        o.enable_logger = true;
        o.loggers = {};
        o.logger_objects = {logger};
        ScaleModule module;
        Trainer trainer(o, comm);
        auto m = trainer.Test(module, data);
        std::lock_guard<std::mutex> lock(mu);
        metrics[rank] = m;
        EXPECT_EQ(module.hooks, (std::vector<std::string>{"on_test_start", "on_test_epoch_end", "on_test_end"}));
        EXPECT_EQ(cb->hooks, (std::vector<std::string>{"cb_on_test_start", "cb_on_test_epoch_end", "cb_on_test_end"}));
        EXPECT_EQ(module.seen_in_epoch_end.at("test_loss"), m.at("test_loss"));  // reduced before the hook
        EXPECT_EQ(cb->test_loss, m.at("test_loss"));
        EXPECT_EQ(trainer.callback_metrics().at("test_acc"), m.at("test_acc"));
        EXPECT_EQ(cb->val_epoch_ends, 0);
        if (rank == 0) {
          ASSERT_EQ(logger->rows.size(), 1u);
          EXPECT_EQ(logger->rows[0].first, 0);  // the current global step
          EXPECT_EQ(logger->rows[0].second.at("test_loss"), m.at("test_loss"));
          EXPECT_EQ(logger->rows[0].second.at("test_acc"), m.at("test_acc"));
        }
      });
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(metrics[r].size(), 3u);  // test_loss, test_acc, rank_mean
        EXPECT_NEAR(metrics[r].at("test_loss"), ref.loss, 1e-12);
        EXPECT_NEAR(metrics[r].at("test_acc"), ref.acc, 1e-12);
        EXPECT_EQ(metrics[r].at("rank_mean"), (world - 1) / 2.0);
        EXPECT_EQ(metrics[r], metrics[0]);
      }
    }
  }
}

TEST(TrainerTest, PredictReturnsEverySampleOnceInDatasetOrder) {
  const TensorDataset data = MakeSet(25);
  const Reference ref = Compute(*MakeNet(), data);
  constexpr int kWorld = 3;
  RunRanks(kWorld, [&](int rank, const auto& comm) {
    ScaleModule module;
    Trainer trainer(EvalOptions("fsdp_native", 4), comm);
    at::Tensor all = trainer.Predict(module, data);
    ASSERT_EQ(all.sizes(), ref.out.sizes());
    EXPECT_TRUE(at::equal(all, ref.out)) << "rank " << rank;
    PredictOptions mine;
    mine.gather = false;
    at::Tensor own = trainer.Predict(module, data, mine);
    const at::Tensor idx = at::arange(rank, data.size(), kWorld, at::kLong);  // rank, rank + W, ...
    ASSERT_EQ(own.size(0), idx.size(0));
    EXPECT_TRUE(at::equal(own, ref.out.index_select(0, idx))) << "rank " << rank;
  });
}

// limit_test_batches / limit_predict_batches: at W=3, batch 4, 2 batches per
// rank cover dataset samples 0..23 (rank r: r, r + 3, ...), all real.
TEST(TrainerTest, TestAndPredictHonourTheirBatchLimits) {
  const TensorDataset data = MakeSet(25);
  const Reference ref = Compute(*MakeNet(), data);
  std::vector<int64_t> first(24);
  for (int64_t i = 0; i < 24; ++i) first[i] = i;
  const Batch head = data.get_batch(first);
  const at::Tensor head_out = ref.out.narrow(0, 0, 24);
  const double head_loss = SampleLoss(head_out, head.targets).mean().item<double>();
  constexpr int kWorld = 3;
  RunRanks(kWorld, [&](int rank, const auto& comm) {
    TrainerOptions o = EvalOptions("fsdp_native", 4);
    o.limit_test_batches = 2;
    o.limit_predict_batches = 2;
    ScaleModule module;
    Trainer trainer(o, comm);
    const auto m = trainer.Test(module, data);
    EXPECT_EQ(module.test_rows, 8);
    EXPECT_NEAR(m.at("test_loss"), head_loss, 1e-12);
    EXPECT_GT(std::abs(m.at("test_loss") - ref.loss), 1e-6);  // the limit changed what was measured
    at::Tensor all = trainer.Predict(module, data);
    ASSERT_EQ(all.size(0), 24);
    EXPECT_TRUE(at::equal(all, head_out)) << "rank " << rank;
    PredictOptions mine;
    mine.gather = false;
    at::Tensor own = trainer.Predict(module, data, mine);
    EXPECT_TRUE(at::equal(own, head_out.index_select(0, at::arange(rank, 24, kWorld, at::kLong)))) << "rank " << rank;
  });
}

TEST(TrainerTest, TestAndPredictAfterFitUseTheFittedShardedModel) {
  const TensorDataset train = MakeSet(48), val = MakeSet(16), test = MakeSet(25);
  const Reference untrained = Compute(*MakeNet(), test);
  RunRanks(2, [&](int rank, const auto& comm) {
    TrainerOptions o = EvalOptions("fsdp_native", 4);
    o.max_epochs = 2;
    auto cb = std::make_shared<RecordingCallback>();
    o.callbacks = {cb};
    ScaleModule module;
    Trainer trainer(o, comm);
    trainer.Fit(module, train, &val);
    // on_validation_epoch_end ran once per validation, after val_loss was reduced.
    EXPECT_EQ(module.val_loss_in_epoch_end, trainer.val_losses());
    EXPECT_EQ(cb->val_epoch_ends, 2);
    const auto m = trainer.Test(module, test);
    const at::Tensor pred = trainer.Predict(module, test);
    const auto state = trainer.strategy().FullStateDict();  // collective; rank 0 gets it
    if (rank != 0) return;
    auto fitted = MakeNet();
    {
      at::NoGradGuard no_grad;
      for (auto& item : fitted->named_parameters()) item.value().copy_(state.at(item.key()));
    }
    const Reference ref = Compute(*fitted, test);
    EXPECT_NEAR(m.at("test_loss"), ref.loss, 1e-12);
    EXPECT_NEAR(m.at("test_acc"), ref.acc, 1e-12);
    EXPECT_GT(std::abs(ref.loss - untrained.loss), 1e-3);  // it did train
    EXPECT_TRUE(at::equal(pred, ref.out));
  });
}

// Predict rows that differ between ranks, a module without test_step or
// predict_step, an empty set and a call inside Fit: InvalidArgumentError.
class NoEvalModule : public ScaleModule {
 public:
  explicit NoEvalModule(int rank) : rank_(rank) {}
  std::optional<at::Tensor> test_step(const Batch& b, int64_t i) override { return TrainingModule::test_step(b, i); }
  at::Tensor predict_step(const Batch& b, int64_t i) override {
    at::Tensor out = ScaleModule::predict_step(b, i);
    return rank_ == 1 ? out.slice(1, 0, 4) : out;  // ranks disagree on the row shape
  }
  void on_train_epoch_end(int64_t) override { trainer().Test(*this, *set); }
  const TensorDataset* set = nullptr;

 private:
  int rank_;
};

TEST(TrainerTest, TestAndPredictRejectWhatCannotWork) {
  const TensorDataset data = MakeSet(10), empty = MakeSet(0);
  RunRanks(2, [&](int rank, const auto& comm) {
    NoEvalModule module(rank);
    Trainer trainer(EvalOptions("fsdp_native", 4), comm);
    try {
      trainer.Test(module, data);
      ADD_FAILURE() << "Test without test_step";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("override it"), std::string::npos) << e.what();
    }
    try {
      trainer.Predict(module, data);
      ADD_FAILURE() << "Predict with rows that differ between ranks";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("differ between ranks"), std::string::npos) << e.what();
    }
    EXPECT_THROW(trainer.Predict(module, empty), InvalidArgumentError);
    module.set = &data;
    try {
      trainer.Fit(module, data);
      ADD_FAILURE() << "Test inside Fit";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("inside Fit"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace shardtrain::trainer
