// "16-mixed" through the Trainer with fsdp_native at W=2 (threads-as-ranks,
// real Gloo): the GradScaler lets it learn, an overflow (a huge init_scale)
// skips steps and backs the scale off identically on every rank without
// touching the parameters, and resuming from a full or a sharded checkpoint
// restores the scaler so the run continues exactly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <mutex>
#include <sstream>

#include "tests/trainer/fixtures.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/optim/grad_scaler.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;

TrainerOptions Fp16Options(const std::string& root) {
  TrainerOptions o = BaseOptions(root, 2);
  o.strategy = "fsdp_native";
  o.precision = "16-mixed";
  return o;
}

// Per rank, after every optimizer step: the scale, whether the step was
// skipped, and whether the parameters (this rank's shards) changed.
struct StepRecord {
  double scale;
  bool skipped;
  bool params_changed;
  bool operator==(const StepRecord& o) const {
    return scale == o.scale && skipped == o.skipped && params_changed == o.params_changed;
  }
};

class ScalerRecorder : public Callback {
 public:
  void on_fit_start(Trainer& t, TrainingModule&) override { Snapshot(t); }
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t) override {
    const GradScaler* s = t.grad_scaler();
    ASSERT_NE(s, nullptr);
    const bool skipped = s->skipped_steps() > skipped_so_far_;
    skipped_so_far_ = s->skipped_steps();
    bool changed = false;
    auto params = t.strategy().parameters();
    for (size_t i = 0; i < params.size(); ++i) changed = changed || !params[i].equal(last_[i]);
    records.push_back({s->scale(), skipped, changed});
    Snapshot(t);
  }
  std::vector<StepRecord> records;

 private:
  void Snapshot(Trainer& t) {
    last_.clear();
    for (const auto& p : t.strategy().parameters()) last_.push_back(p.detach().clone());
  }
  int64_t skipped_so_far_ = 0;
  std::vector<at::Tensor> last_;
};

TEST(MixedPrecision, Fp16FsdpNativeLearnsWithGradScaler) {
  TrainerOptions o = Fp16Options(TmpDir("fp16_learn"));
  std::mutex mu;
  std::vector<double> final_scales;
  FitResult r = Fit(2, o, "", {}, [&](int, Trainer& t, Classifier&) {
    ASSERT_NE(t.grad_scaler(), nullptr);
    std::lock_guard<std::mutex> lock(mu);
    final_scales.push_back(t.grad_scaler()->scale());
  });
  ASSERT_EQ(r.losses.size(), 12u);
  EXPECT_LT(r.losses.back(), r.losses.front() * 0.9);
  ASSERT_EQ(r.val_losses.size(), 3u);
  EXPECT_LT(r.val_losses.back(), r.val_losses.front());
  ASSERT_EQ(final_scales.size(), 2u);
  EXPECT_EQ(final_scales[0], final_scales[1]);
  EXPECT_GT(final_scales[0], 0);
  // The scale is logged next to the loss.
  std::ifstream csv(fs::path(r.log_dir) / "metrics.csv");
  std::string header;
  std::getline(csv, header);
  EXPECT_NE(header.find("grad_scale"), std::string::npos) << header;
  // Other precisions have no scaler.
  TrainerOptions bf16 = Fp16Options(TmpDir("bf16_no_scaler"));
  bf16.precision = "bf16-mixed";
  bf16.max_epochs = 1;
  Fit(2, bf16, "", {}, [](int, Trainer& t, Classifier&) { EXPECT_EQ(t.grad_scaler(), nullptr); });
}

TEST(MixedPrecision, OverflowSkipsTheSameStepsOnEveryRank) {
  TrainerOptions o = Fp16Options(TmpDir("fp16_overflow"));
  o.max_epochs = 5;  // 20 steps
  o.grad_scaler.init_scale = std::ldexp(1.0, 24);  // float16 gradients overflow until it backs off to ~2^15
  o.grad_scaler.growth_interval = 2;
  std::vector<std::shared_ptr<ScalerRecorder>> recorders = {std::make_shared<ScalerRecorder>(),
                                                            std::make_shared<ScalerRecorder>()};
  FitResult r = Fit(2, o, "", {}, nullptr, [&](int rank) { return std::vector<CallbackPtr>{recorders[rank]}; });
  ASSERT_EQ(r.global_step, 20);  // skipped steps still count as steps (Lightning)
  const auto& a = recorders[0]->records;
  ASSERT_EQ(a.size(), 20u);
  EXPECT_EQ(a, recorders[1]->records) << "ranks disagree on skipped steps or scale";
  int skipped = 0;
  double scale = o.grad_scaler.init_scale;
  int clean_in_a_row = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    if (a[i].skipped) {
      ++skipped;
      clean_in_a_row = 0;
      scale *= 0.5;
      EXPECT_FALSE(a[i].params_changed) << "a skipped step changed the parameters";
    } else {
      EXPECT_TRUE(a[i].params_changed);
      if (++clean_in_a_row == 2) {
        scale *= 2;
        clean_in_a_row = 0;
      }
    }
    EXPECT_EQ(a[i].scale, scale);
  }
  EXPECT_TRUE(a[0].skipped && a[1].skipped) << "2^24 must overflow float16 gradients";
  EXPECT_GE(skipped, 8);
  EXPECT_LT(skipped, 20);
  EXPECT_LT(a.back().scale, o.grad_scaler.init_scale);
  // The checkpoint holds the scaler (torch.amp.GradScaler's keys).
  CheckpointData ck = LoadCheckpoint(r.last_ckpt);
  ASSERT_TRUE(ck.grad_scaler.has_value());
  EXPECT_EQ(ck.grad_scaler->scale, a.back().scale);
  EXPECT_EQ(ck.grad_scaler->growth_interval, 2);
}

TEST(MixedPrecision, ResumeRestoresTheScalerExactly) {
  for (const std::string sdt : {"full", "sharded"}) {
    SCOPED_TRACE(sdt);
    auto opts = [&](const std::string& dir) {
      TrainerOptions o = Fp16Options(TmpDir(dir + sdt));
      o.strategy_options = {{"state_dict_type", sdt}};
      o.grad_scaler.init_scale = std::ldexp(1.0, 18);
      o.grad_scaler.growth_interval = 4;
      return o;
    };
    std::mutex mu;
    GradScalerState full_state, resumed_state;
    FitResult full = Fit(2, opts("fp16_resume_full_"), "", {}, [&](int rank, Trainer& t, Classifier&) {
      if (rank == 0) full_state = t.grad_scaler()->state();
    });
    ASSERT_EQ(full.losses.size(), 12u);
    TrainerOptions first = opts("fp16_resume_a_");
    first.max_steps = 6;
    FitResult a = Fit(2, first);
    ASSERT_EQ(a.losses.size(), 6u);
    // The saved state is not the initial one, so resuming without it would differ.
    GradScalerState saved = sdt == "full" ? *LoadCheckpoint(a.last_ckpt).grad_scaler
                                          : *OpenDcpCheckpoint(a.last_ckpt).meta.grad_scaler;
    EXPECT_TRUE(saved.scale != std::ldexp(1.0, 18) || saved.growth_tracker != 0)
        << "scale " << saved.scale << " tracker " << saved.growth_tracker;
    FitResult b = Fit(2, opts("fp16_resume_b_"), a.last_ckpt, {}, [&](int rank, Trainer& t, Classifier&) {
      if (rank == 0) resumed_state = t.grad_scaler()->state();
    });
    ASSERT_EQ(b.losses.size(), 6u);
    for (size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(a.losses[i], full.losses[i]) << "step " << i;
      EXPECT_NEAR(b.losses[i], full.losses[6 + i], 1e-6) << "step " << 6 + i;
    }
    EXPECT_EQ(resumed_state.scale, full_state.scale);
    EXPECT_EQ(resumed_state.growth_tracker, full_state.growth_tracker);
  }
}

}  // namespace
}  // namespace shardtrain::trainer
