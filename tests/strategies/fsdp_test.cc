// fsdp and fsdp_native specifics: the gradient pre/post divide factors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/strategies/strategy_fixture.h"

namespace shardtrain::strategies {
namespace {

TEST(Fsdp, GradientDivideFactorsScaleTheReducedGradient) {
  auto tm = shardtrain::testing::MlpWithBatchNorm();
  auto grads = [&](const StrategyOptions& opts) {
    std::vector<std::shared_ptr<torch::nn::Module>> models{tm.make(), tm.make()};
    std::vector<at::Tensor> out;
    std::mutex mu;
    RunRanks(2, [&](int rank, const auto& comm) {
      auto s = StrategyRegistry::Create("fsdp", opts);
      s->Setup(comm, {});
      s->WrapModel(models[rank]);
      auto [x, y] = tm.data(0, 8);
      s->Backward(tm.loss(s->Forward([&] { return tm.forward(s->module(), x.slice(0, rank * 4, rank * 4 + 4)); }),
                          y.slice(0, rank * 4, rank * 4 + 4)));
      if (rank != 0) return;
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& p : s->parameters()) out.push_back(p.grad().clone());
    });
    return out;
  };
  const auto mean = grads({});
  ASSERT_FALSE(mean.empty());
  const std::vector<std::pair<StrategyOptions, double>> cases = {
      {{{"gradient_predivide_factor", "1"}, {"gradient_postdivide_factor", "1"}}, 2.0},  // the sum
      {{{"gradient_predivide_factor", "4"}, {"gradient_postdivide_factor", "1"}}, 0.5},
      {{{"gradient_predivide_factor", "1"}, {"gradient_postdivide_factor", "4"}}, 0.5},
      {{{"gradient_predivide_factor", "2"}}, 1.0},  // the post factor defaults to W / pre
  };
  for (const auto& [opts, scale] : cases) {
    const auto got = grads(opts);
    ASSERT_EQ(got.size(), mean.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::allclose(got[i], mean[i] * scale, 1e-5, 1e-7))
          << opts.begin()->first << "=" << opts.begin()->second << " (x" << scale << "): parameter " << i;
    }
  }
}

}  // namespace
}  // namespace shardtrain::strategies
