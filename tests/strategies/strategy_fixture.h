// The shared fixture of the strategy tests: ErrorOf (an InvalidArgumentError's
// text), and Train/ExpectSame, one training run of the MLP-with-BatchNorm through
// a strategy (threads-as-ranks over real Gloo) compared with another.
#ifndef SHARDTRAIN_TESTS_STRATEGIES_STRATEGY_FIXTURE_H_
#define SHARDTRAIN_TESTS_STRATEGIES_STRATEGY_FIXTURE_H_

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "sharding/wrap_point.h"
#include "strategies/ddp/ddp_strategy.h"
#include "strategies/fsdp/fsdp_strategy.h"
#include "strategies/fsdp_native/fsdp_native_strategy.h"
#include "strategies/registry.h"
#include "tests/testing/models.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::strategies {

using shardtrain::testing::RunRanks;

template <typename F>
std::string ErrorOf(F&& f) {
  try {
    f();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "<no InvalidArgumentError>";
}

// ---------------------------------------------------------------------------
// Parity

inline constexpr int kSteps = 6;
inline constexpr int kMicro = 2;  // micro-batches per step (gradient accumulation)
inline constexpr int64_t kGlobalBatch = 8;
inline constexpr double kClip = 0.5;

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> state;
};

// Each rank takes its slice of each micro-batch; the first micro-batch
// backward does not sync; gradients are clipped by norm, then Adam steps.
inline RunResult Train(const std::string& name, const StrategyOptions& opts, int world, bool clip = true, int micro = kMicro) {
  auto tm = shardtrain::testing::MlpWithBatchNorm();
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(tm.make());
  RunResult result;
  std::mutex mu;
  RunRanks(world, [&](int rank, const auto& comm) {
    auto s = StrategyRegistry::Create(name, opts);
    ClusterInfo cluster;
    s->Setup(world == 1 && name == "single_device" ? nullptr : comm::CommunicatorPtr(comm), cluster);
    s->WrapModel(models[rank]);
    s->module().train();
    torch::optim::Adam opt(s->parameters(), torch::optim::AdamOptions(1e-2));
    const int64_t per = kGlobalBatch / micro / world;
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      double total = 0;
      for (int m = 0; m < micro; ++m) {
        auto [x, y] = tm.data(m, kGlobalBatch / micro);  // the same two micro-batches: loss must fall
        x = x.slice(0, rank * per, (rank + 1) * per);
        y = y.slice(0, rank * per, (rank + 1) * per);
        at::Tensor out = s->Forward([&] { return tm.forward(s->module(), x); });
        at::Tensor loss = tm.loss(out, y);
        s->Backward(loss / micro, /*sync_gradients=*/m == micro - 1);
        total += s->ReduceMean(loss.item<double>()) / micro;
      }
      if (clip) s->ClipGradients(kClip, GradClipAlgorithm::kNorm);
      opt.step();
      opt.zero_grad();
      losses.push_back(total);
    }
    auto state = s->FullStateDict();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result.losses = losses;
      result.state = state;
    }
  });
  return result;
}

inline void ExpectSame(const RunResult& ref, const RunResult& got, double tol) {
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], tol) << "step " << i;
  for (const auto& [k, v] : ref.state) {
    if (k.find("running") != std::string::npos || k.find("num_batches") != std::string::npos) continue;
    auto it = got.state.find(k);
    ASSERT_NE(it, got.state.end()) << k;
    EXPECT_LE((it->second - v).abs().max().item<double>(), tol) << k;
  }
}

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_TESTS_STRATEGIES_STRATEGY_FIXTURE_H_
