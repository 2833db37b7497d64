// The full checkpoint's layout pieces without a Trainer (trainer/checkpoint_io):
// typed values and their text forms, the optimizer state by index named by a
// run's groups (and the errors when they do not fit), a round trip through
// the file.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include "base/errors.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/state_value.h"

namespace shardtrain::trainer {
namespace {

std::string Tmp(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  return (std::filesystem::path(t ? t : "/tmp") / name).string();
}

TEST(StateValue, InfersTheTypeATextSpellsAndWritesTextThatReadsBack) {
  EXPECT_TRUE(StateValue::Infer("3").is<int64_t>());
  EXPECT_TRUE(StateValue::Infer("-12").is<int64_t>());
  EXPECT_TRUE(StateValue::Infer("0.5").is<double>());
  EXPECT_TRUE(StateValue::Infer("1e-05").is<double>());
  EXPECT_TRUE(StateValue::Infer("inf").is<double>());
  EXPECT_TRUE(StateValue::Infer("true").is<bool>() && StateValue::Infer("True").get<bool>());
  EXPECT_TRUE(StateValue::Infer("None").is_none());
  for (const std::string s : {"gelu", "", "1.2.3", "e5", "0x", "3 apples"}) {
    EXPECT_TRUE(StateValue::Infer(s).is<std::string>()) << s;
  }
  for (const double d : {0.1, 1e-7, 2.0, -3.5e300, 1.0 / 3.0}) {
    const StateValue v(d);
    EXPECT_TRUE(StateValue::Infer(v.ToString()) == v) << v.ToString();
  }
  EXPECT_EQ(StateValue(2.0).ToString(), "2.0");  // a float, not the int 2
  EXPECT_EQ(StateValue(1e-5).ToString(), "1e-05");
  EXPECT_TRUE(std::isnan(StateValue::Infer(StateValue(std::nan("")).ToString()).get<double>()));
  EXPECT_TRUE(StateValue(size_t{7}) == StateValue(7));  // any integer type is an int
  EXPECT_TRUE(StateValue("x").is<std::string>());      // a literal is a str, never a bool
  EXPECT_THROW(StateValue("x").AsDouble(), InvalidArgumentError);
}

CheckpointData Small() {
  CheckpointData d;
  d.state_dict = {{"a.weight", at::ones({2, 3})}, {"a.bias", at::zeros({2})}, {"frozen", at::ones({4})}};
  d.hparams = {{"width", 8}, {"lr", 3e-4}, {"act", "gelu"}, {"tied", false}};
  d.optimizer_full.kind = "AdamW";
  d.optimizer_full.state["a.weight"] = {{"exp_avg", at::full({2, 3}, 0.5)}, {"exp_avg_sq", at::full({2, 3}, 0.25)}};
  d.optimizer_full.state["a.bias"] = {{"exp_avg", at::full({2}, 0.5)}, {"exp_avg_sq", at::full({2}, 0.25)}};
  d.optimizer_full.step = {{"a.weight", 7}, {"a.bias", 7}};
  // Two groups, in the optimizer's order: the bias first.
  d.optimizer_groups = {{{"a.bias"}, {{"lr", 0.1}, {"betas", std::vector<double>{0.9, 0.95}}}},
                        {{"a.weight"}, {{"lr", 0.2}, {"betas", std::vector<double>{0.9, 0.95}}}}};
  d.callbacks["EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"] = {{"wait_count", 2},
                                                                       {"best_score", ScoreTensor{0.25}}};
  d.lr_schedulers = {{{"type", "StepLR"}, {"last_epoch", "7"}, {"base_lrs", "0.1,0.2"}, {"_last_lr", "0.05,0.1"},
                      {"optimizer_lrs", "0.05,0.1"}}};
  d.epoch = 1;
  d.batch_in_epoch = 3;
  d.global_step = 7;
  return d;
}

TEST(FullCheckpoint, RoundTripKeepsTypesGroupsAndTheOptimizersOrder) {
  const std::string path = Tmp("layout_round_trip.ckpt");
  SaveCheckpoint(path, Small());
  const CheckpointData d = LoadCheckpoint(path);
  EXPECT_FALSE(d.legacy_layout);
  EXPECT_TRUE(d.hparams.at("width") == StateValue(8));
  EXPECT_TRUE(d.hparams.at("lr") == StateValue(3e-4));
  EXPECT_TRUE(d.hparams.at("tied") == StateValue(false));
  ASSERT_EQ(d.optimizer_groups.size(), 2u);
  EXPECT_EQ(d.optimizer_groups[0].params, std::vector<std::string>{"a.bias"});
  EXPECT_TRUE(d.optimizer_groups[1].options.at("betas") == StateValue(std::vector<double>{0.9, 0.95}));
  EXPECT_EQ(d.optimizer_full.kind, "AdamW");
  EXPECT_EQ(d.optimizer_full.step.at("a.weight"), 7);
  EXPECT_TRUE(d.optimizer_full.state.at("a.weight").at("exp_avg_sq").equal(at::full({2, 3}, 0.25)));
  EXPECT_TRUE(d.callbacks.begin()->second.at("best_score") == StateValue(ScoreTensor{0.25}));
  ASSERT_EQ(d.lr_schedulers.size(), 1u);
  EXPECT_EQ(d.lr_schedulers[0].at("last_epoch"), "7");
  EXPECT_EQ(d.lr_schedulers[0].count("optimizer_lrs"), 0u) << "the groups hold the lrs, not a scheduler's state";
  EXPECT_EQ(d.epoch, 1);
  EXPECT_EQ(d.batch_in_epoch, 3);  // from "shardtrain"; the loops say epoch 1 under way too
}

// A Python file holds the optimizer state by index: a run's groups name it.
CheckpointData Indexed() {
  CheckpointData d;
  d.optimizer_groups = {{{}, {{"lr", 0.1}}}, {{}, {{"lr", 0.2}}}};
  d.optimizer_indexed.group_sizes = {1, 2};
  d.optimizer_indexed.state[0] = {{"exp_avg", at::ones({2})}, {"exp_avg_sq", at::ones({2})}};
  d.optimizer_indexed.state[2] = {{"exp_avg", at::ones({3})}, {"exp_avg_sq", at::ones({3})}};
  d.optimizer_indexed.step = {{0, 4}, {2, 4}};
  return d;
}

TEST(FullCheckpoint, StateByIndexIsNamedByTheRunsGroups) {
  CheckpointData d = Indexed();
  NameOptimizerState(d, {{"x"}, {"y", "z"}}, "Adam", "p.ckpt");
  EXPECT_EQ(d.optimizer_full.kind, "Adam");
  EXPECT_EQ(d.optimizer_full.state.count("x"), 1u);
  EXPECT_EQ(d.optimizer_full.state.count("y"), 0u);  // index 1 had no state
  EXPECT_EQ(d.optimizer_full.state.at("z").at("exp_avg").numel(), 3);
  EXPECT_EQ(d.optimizer_full.step.at("z"), 4);
  EXPECT_TRUE(d.optimizer_indexed.empty());
}

TEST(FullCheckpoint, StateByIndexThatDoesNotFitNamesTheGroupsOrTheKeys) {
  CheckpointData d = Indexed();
  try {
    NameOptimizerState(d, {{"x", "y", "z"}}, "Adam", "p.ckpt");
    ADD_FAILURE() << "no error for other group sizes";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'p.ckpt'"), std::string::npos) << what;
    EXPECT_NE(what.find("groups of [1, 2] parameters, this run's optimizer [3]"), std::string::npos) << what;
  }
  EXPECT_TRUE(d.optimizer_full.empty()) << "nothing is named after an error";
  try {
    NameOptimizerState(d, {{"x"}, {"y", "z"}}, "SGD", "p.ckpt");
    ADD_FAILURE() << "no error for Adam's state into SGD";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has keys {exp_avg, exp_avg_sq}, not those of this run's optimizer SGD"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace shardtrain::trainer
