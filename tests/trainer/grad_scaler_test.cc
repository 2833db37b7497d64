// GradScaler on its own: scaling, unscaling, inf/NaN detection (also when
// only another rank overflowed, over real Gloo), the backoff/growth rule
// against torch's _amp_update_scale_ semantics, state and option checks.
#include "trainer/optim/grad_scaler.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>

#include "base/errors.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::trainer {
namespace {

at::Tensor ParamWithGrad(at::Tensor grad) {
  at::Tensor p = at::zeros(grad.sizes(), grad.options());
  p.mutable_grad() = std::move(grad);
  return p;
}

TEST(GradScaler, ScalesLossInFloat32) {
  GradScaler s;
  EXPECT_EQ(s.scale(), 65536.0);
  at::Tensor half_loss = at::full({}, 0.5, at::kHalf);
  at::Tensor scaled = s.Scale(half_loss);
  EXPECT_EQ(scaled.scalar_type(), at::kFloat);  // 0.5 * 2^16 would overflow float16's 65504
  EXPECT_EQ(scaled.item<float>(), 32768.0f);
}

TEST(GradScaler, UnscalesExactlyAndFindsInfAndNan) {
  GradScalerOptions o;
  o.init_scale = 1024;
  GradScaler s(o);
  at::Tensor a = ParamWithGrad(at::full({3}, 2048.0));
  at::Tensor b = ParamWithGrad(at::full({2}, -512.0, at::kDouble));
  at::Tensor no_grad = at::zeros({4});
  EXPECT_FALSE(s.Unscale({a, b, no_grad}, nullptr));
  EXPECT_TRUE(a.grad().equal(at::full({3}, 2.0)));
  EXPECT_TRUE(b.grad().equal(at::full({2}, -0.5, at::kDouble)));

  at::Tensor inf = ParamWithGrad(at::tensor({1.0f, std::numeric_limits<float>::infinity()}));
  EXPECT_TRUE(s.Unscale({a, inf}, nullptr));
  at::Tensor nan = ParamWithGrad(at::tensor({std::numeric_limits<float>::quiet_NaN()}));
  EXPECT_TRUE(s.Unscale({nan}, nullptr));
}

TEST(GradScaler, BackoffAndGrowthFollowTorch) {
  GradScalerOptions o;
  o.init_scale = 8;
  o.growth_interval = 3;
  GradScaler s(o);
  s.Update(true);  // overflow: halve, reset the tracker
  EXPECT_EQ(s.scale(), 4);
  EXPECT_EQ(s.growth_tracker(), 0);
  EXPECT_EQ(s.skipped_steps(), 1);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 4);
  EXPECT_EQ(s.growth_tracker(), 2);
  s.Update(false);  // third clean step in a row: double
  EXPECT_EQ(s.scale(), 8);
  EXPECT_EQ(s.growth_tracker(), 0);
  s.Update(false);
  s.Update(true);  // an overflow resets the count
  EXPECT_EQ(s.scale(), 4);
  EXPECT_EQ(s.growth_tracker(), 0);
  EXPECT_EQ(s.skipped_steps(), 2);
  // Same sequence through torch's own kernel.
  at::Tensor scale = at::full({1}, 8.0f), tracker = at::zeros({1}, at::kInt);
  for (bool inf : {true, false, false, false, false, true}) {
    at::Tensor found = at::full({1}, inf ? 1.0f : 0.0f);
    at::_amp_update_scale_(scale, tracker, found, 2.0, 0.5, 3);
  }
  EXPECT_EQ(scale.item<float>(), s.scale());
  EXPECT_EQ(tracker.item<int>(), s.growth_tracker());
  // Growth stops at float32's largest finite power of two.
  o.init_scale = std::ldexp(1.0, 127);
  o.growth_interval = 1;
  GradScaler big(o);
  big.Update(false);
  EXPECT_EQ(big.scale(), std::ldexp(1.0, 127));
}

TEST(GradScaler, StateRoundTripAndChecks) {
  GradScalerOptions o;
  o.growth_interval = 5;
  GradScaler a(o);
  a.Update(true);
  a.Update(false);
  GradScaler b;
  b.load_state(a.state());
  EXPECT_EQ(b.scale(), 32768.0);
  EXPECT_EQ(b.growth_tracker(), 1);
  EXPECT_EQ(b.state().growth_interval, 5);
  GradScalerState bad = a.state();
  bad.scale = -1;
  EXPECT_THROW(b.load_state(bad), InvalidArgumentError);
  EXPECT_EQ(b.scale(), 32768.0);  // unchanged
  auto msg = [](GradScalerOptions o) -> std::string {
    try {
      GradScaler s(o);
    } catch (const InvalidArgumentError& e) {
      return e.what();
    }
    return "";
  };
  o = {};
  o.backoff_factor = 1.5;
  EXPECT_NE(msg(o).find("backoff_factor must be in (0, 1), got 1.5"), std::string::npos) << msg(o);
  o = {};
  o.growth_factor = 1;
  EXPECT_NE(msg(o).find("growth_factor must be > 1"), std::string::npos) << msg(o);
  o = {};
  o.growth_interval = 0;
  EXPECT_NE(msg(o).find("growth_interval must be >= 1"), std::string::npos) << msg(o);
  o = {};
  o.init_scale = 0;
  EXPECT_NE(msg(o).find("scale must be finite and > 0"), std::string::npos) << msg(o);
}

// Rank 1's gradient shard overflows, rank 0's does not: with the found-inf
// flag all-reduced (MAX) over Gloo both skip, and both back off.
TEST(GradScaler, FoundInfIsCombinedOverRanks) {
  std::atomic<int> skipped{0};
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    GradScaler s;
    at::Tensor g = rank == 1 ? at::tensor({1.0f, std::numeric_limits<float>::infinity()}) : at::ones({2});
    at::Tensor p = ParamWithGrad(g);
    auto reduce_max = [&](double v) {
      at::Tensor t = at::full({1}, v, at::kDouble);
      comm->AllReduce(t, {comm::ReduceOp::kMax})->Wait();
      return t.item<double>();
    };
    EXPECT_FALSE(s.Unscale({ParamWithGrad(at::ones({2}))}, reduce_max));  // clean everywhere
    const bool inf = s.Unscale({p}, reduce_max);
    EXPECT_TRUE(inf) << "rank " << rank;
    s.Update(inf);
    EXPECT_EQ(s.scale(), 32768.0);
    if (inf) ++skipped;
  });
  EXPECT_EQ(skipped.load(), 2);
}

}  // namespace
}  // namespace shardtrain::trainer
