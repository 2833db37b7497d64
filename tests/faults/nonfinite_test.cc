// TrainerOptions::nonfinite at W=2 (threads-as-ranks, real Gloo, fsdp_native):
// the loss becomes NaN at global step 3 on rank 1 only.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "base/errors.h"
#include "tests/faults/tiny_model.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::faults {
namespace {
using trainer::Trainer;
using trainer::TrainerOptions;

TrainerOptions Options(const std::string& nonfinite, int64_t max_steps) {
  TrainerOptions o;
  const char* t = std::getenv("TEST_TMPDIR");
  o.default_root_dir = std::string(t ? t : "/tmp") + "/nonfinite_" + nonfinite + std::to_string(max_steps);
  o.strategy = "fsdp_native";
  o.max_steps = max_steps;
  o.batch_size = 8;
  o.enable_progress_bar = false;
  o.enable_checkpointing = false;
  o.enable_logger = false;
  o.seed = 3;
  o.nonfinite = nonfinite;
  return o;
}

struct RankResult {
  std::string error;                  // what Fit threw ("" if nothing)
  std::vector<at::Tensor> params;     // this rank's shards after Fit
  std::vector<double> losses;
  int64_t skipped = 0;
};

// Fits at W=2 with the loss NaN at global step 3 on rank 1 (when nan).
std::vector<RankResult> FitW2(const std::string& nonfinite, int64_t max_steps, bool nan = true) {
  auto train = TinyData(64, 1);
  std::vector<RankResult> out(2);
  testing::RunRanks(2, [&](int rank, const auto& comm) {
    TinyModule module;
    if (nan) {
      module.nan_step = 3;
      module.nan_rank = 1;
    }
    Trainer t(Options(nonfinite, max_steps), comm);
    try {
      t.Fit(module, *train);
    } catch (const trainer::NonfiniteError& e) {
      out[rank].error = e.what();
    }
    for (const auto& p : t.strategy().parameters()) out[rank].params.push_back(p.detach().clone());
    out[rank].losses = t.step_losses();
    out[rank].skipped = t.skipped_nonfinite_steps();
  });
  return out;
}

bool AllFinite(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (!at::isfinite(t).all().item<bool>()) return false;
  return true;
}

TEST(Nonfinite, ErrorStopsEveryRankNamingTheStepAndWhat) {
  const auto r = FitW2("error", 6);
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    EXPECT_NE(r[rank].error.find("non-finite value at global step 3"), std::string::npos) << r[rank].error;
    EXPECT_EQ(r[rank].losses.size(), 3u);  // steps 0..2 done, step 3 stopped
    EXPECT_TRUE(AllFinite(r[rank].params));
  }
  // Rank 1 found its loss; rank 0, whose loss is finite, found the NaN in its
  // gradient shard after the reduce-scatter and names the parameter.
  EXPECT_NE(r[1].error.find("the loss is "), std::string::npos) << r[1].error;
  EXPECT_NE(r[1].error.find("nan on rank 1"), std::string::npos) << r[1].error;
  EXPECT_NE(r[0].error.find("the gradient of '"), std::string::npos) << r[0].error;
  EXPECT_NE(r[0].error.find("' is not finite on rank 0"), std::string::npos) << r[0].error;
}

TEST(Nonfinite, SkipSkipsTheStepOnEveryRank) {
  // Steps 0..2, then step 3 (NaN on rank 1) skipped: the parameters equal
  // those of a run that stopped after 3 steps, bit for bit, on both ranks.
  const auto skipped = FitW2("skip", 4);
  const auto three = FitW2("off", 3, /*nan=*/false);
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    EXPECT_TRUE(skipped[rank].error.empty()) << skipped[rank].error;
    EXPECT_EQ(skipped[rank].skipped, 1);
    ASSERT_EQ(skipped[rank].losses.size(), 4u);
    EXPECT_TRUE(std::isnan(skipped[rank].losses[3]));
    ASSERT_EQ(skipped[rank].params.size(), three[rank].params.size());
    for (size_t i = 0; i < three[rank].params.size(); ++i) {
      EXPECT_TRUE(at::equal(skipped[rank].params[i], three[rank].params[i])) << "parameter " << i;
    }
  }
}

TEST(Nonfinite, OffTrainsOnWithTheNaN) {
  const auto r = FitW2("off", 4);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(r[rank].error.empty());
    EXPECT_EQ(r[rank].skipped, 0);
    EXPECT_FALSE(AllFinite(r[rank].params));
  }
}

TEST(Nonfinite, BadModeNamesTheValidOnes) {
  TrainerOptions o;
  o.nonfinite = "warn";
  try {
    Trainer t(o);
    FAIL() << "no error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("nonfinite must be one of \"off\", \"error\", \"skip\", got \"warn\""),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace shardtrain::faults
