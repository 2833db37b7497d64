// trainer/loops/internal/loss_sum.h on the CPU: the step's losses summed in
// double in the order added, counted, reset; a loss that is not a scalar is
// refused with what was returned. (The CUDA side, no device wait per
// micro-batch, is in tests/cuda/cuda_fixes_test.cc.)
#include "trainer/loops/internal/loss_sum.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "base/errors.h"

namespace shardtrain::trainer::internal {
namespace {

TEST(LossSum, SumsInDoubleCountsAndResets) {
  LossSum sum;
  EXPECT_EQ(sum.Read(), 0.0);
  const float a = 0.1f, b = 1e8f, c = 3.3f;
  sum.Add(at::scalar_tensor(a));
  sum.Add(at::scalar_tensor(b).reshape({1}));  // one element of any shape
  sum.Add(at::scalar_tensor(c, at::kBFloat16));
  const double expected =
      static_cast<double>(a) + static_cast<double>(b) + static_cast<double>(c10::BFloat16(c));
  EXPECT_EQ(sum.Read(), expected);
  EXPECT_EQ(sum.count(), 3);
  sum.Reset();
  EXPECT_EQ(sum.Read(), 0.0);
  EXPECT_EQ(sum.count(), 0);
}

TEST(LossSum, RefusesANonScalarLoss) {
  LossSum sum;
  try {
    sum.Add(at::ones({2, 3}));
    FAIL() << "a loss of 6 elements was accepted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("training_step must return a scalar loss; got a tensor of 6 elements"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(sum.Add(at::Tensor()), InvalidArgumentError);
}

}  // namespace
}  // namespace shardtrain::trainer::internal
