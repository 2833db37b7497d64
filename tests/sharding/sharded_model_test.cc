// FSDP core against unsharded training: threads-as-ranks over real Gloo.
#include "sharding/sharded_model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <map>
#include <mutex>

#include "base/errors.h"
#include "tests/testing/models.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::sharding {
namespace {

using shardtrain::testing::RunRanks;
using shardtrain::testing::TestModel;

constexpr int kSteps = 10;
constexpr int64_t kGlobalBatch = 16;

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const std::string& kind, std::vector<at::Tensor> params) {
  // eps 1e-6: some parameters have mathematically zero gradients (a key bias
  // under softmax, a bias before BatchNorm); their float rounding noise differs
  // with the reduction order, and Adam with a tiny eps blows noise up to full steps.
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).eps(1e-6));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
}

struct RunResult {
  std::vector<double> losses;                  // global loss per step
  std::map<std::string, at::Tensor> params;   // final parameters by name
  std::vector<std::string> units;              // unit names (sharded runs), root ("") last
  int64_t all_gathers = 0;                     // rank 0's all-gather calls in the steps (sharded runs)
};

// Plain single-process training on the global batch, split in `chunks`
// micro-batches exactly like the ranks split it (BatchNorm sees the same batches).
RunResult Reference(const TestModel& tm, const std::string& opt_kind, int chunks) {
  auto model = tm.make();
  model->train();
  auto opt = MakeOptimizer(opt_kind, model->parameters());
  RunResult r;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = tm.data(step, kGlobalBatch);
    opt->zero_grad();
    double total = 0;
    const int64_t per = kGlobalBatch / chunks;
    for (int c = 0; c < chunks; ++c) {
      at::Tensor loss = tm.loss(tm.forward(*model, x.slice(0, c * per, (c + 1) * per)), y.slice(0, c * per, (c + 1) * per));
      (loss / chunks).backward();
      total += loss.item<double>() / chunks;
    }
    opt->step();
    r.losses.push_back(total);
  }
  for (const auto& p : model->named_parameters()) r.params[p.key()] = p.value().detach().clone();
  return r;
}

RunResult Sharded(const TestModel& tm, const std::string& opt_kind, int world, ShardingOptions options,
                  const std::function<WrapPolicy(torch::nn::Module&)>& policy) {
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(tm.make());
  RunResult result;
  std::mutex mu;
  RunRanks(world, [&](int rank, const auto& comm) {
    ShardedModel sm(models[rank], comm, options, policy(*models[rank]));
    sm.module().train();
    auto opt = MakeOptimizer(opt_kind, sm.parameters());
    const int64_t per = kGlobalBatch / world;
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = tm.data(step, kGlobalBatch);
      x = x.slice(0, rank * per, (rank + 1) * per);
      y = y.slice(0, rank * per, (rank + 1) * per);
      opt->zero_grad();
      at::Tensor out = sm.Forward([&] { return tm.forward(sm.module(), x); });
      at::Tensor loss = tm.loss(out, y);
      loss.backward();
      opt->step();
      at::Tensor l = loss.detach().clone().reshape({1});
      comm->AllReduce(l, {comm::ReduceOp::kAvg})->Wait();
      losses.push_back(l.item<double>());
    }
    const int64_t gathers = comm->stats().Calls(comm::CommOp::kAllGather);  // the steps' (not the state dict's)
    auto full = sm.FullStateDict(/*rank0_only=*/true);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result.losses = losses;
      result.params = full;
      for (const auto& u : sm.units()) result.units.push_back(u.name);
      result.all_gathers = gathers;
    }
  });
  return result;
}

double MaxRelError(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

void ExpectMatches(const RunResult& ref, const RunResult& got, double tol) {
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol * std::abs(ref.losses[i])) << "step " << i;
  }
  for (const auto& [name, p] : ref.params) {
    auto it = got.params.find(name);
    ASSERT_NE(it, got.params.end()) << "missing " << name;
    EXPECT_LE(MaxRelError(it->second, p), tol) << name;
  }
}

// How a case wraps its model: every wrap point a unit, none (the root unit
// only), or some (mlp_bn: size-based, b2 only; gpt: a custom policy, h.1 only).
enum class Wrap { kAll, kNone, kSome };
const char* WrapName(Wrap w) { return w == Wrap::kAll ? "all" : w == Wrap::kNone ? "none" : "some"; }

struct ParityCase {
  std::string model;
  int world;
  ShardingStrategy strategy;
  std::string optimizer;
  Wrap wrap;
};

WrapPolicy PolicyFor(const ParityCase& c, torch::nn::Module& model) {
  switch (c.wrap) {
    case Wrap::kAll: return WrapPolicy::Always();
    case Wrap::kNone: return WrapPolicy::Never();
    case Wrap::kSome: break;
  }
  // mlp_bn's b1 has 336 parameters, b2 624. gpt's blocks are equal in size: a custom policy picks h.1.
  if (c.model == "mlp_bn") return WrapPolicy::SizeBased(500);
  std::shared_ptr<torch::nn::Module> h1 = model.named_modules()["h.1"];
  return {[h1](const WrapPoint& p, int64_t) { return dynamic_cast<const torch::nn::Module*>(&p) == h1.get(); }};
}

// The unit names each wrapping must give.
std::vector<std::string> ExpectedUnits(const ParityCase& c) {
  const bool gpt = c.model == "gpt";
  switch (c.wrap) {
    case Wrap::kAll: return gpt ? std::vector<std::string>{"h.0", "h.1", "h.2", ""} : std::vector<std::string>{"b1", "b2", ""};
    case Wrap::kNone: return {""};
    case Wrap::kSome: return gpt ? std::vector<std::string>{"h.1", ""} : std::vector<std::string>{"b2", ""};
  }
  return {};
}

class Parity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(Parity, MatchesUnshardedTraining) {
  const auto& c = GetParam();
  TestModel tm = c.model == "gpt" ? shardtrain::testing::TinyGpt() : shardtrain::testing::MlpWithBatchNorm();
  ShardingOptions o;
  o.sharding_strategy = c.strategy;
  o.hybrid_shard_group_size = 2;
  RunResult ref = Reference(tm, c.optimizer, c.world);
  RunResult got = Sharded(tm, c.optimizer, c.world, o, [&](torch::nn::Module& m) { return PolicyFor(c, m); });
  ASSERT_EQ(got.units, ExpectedUnits(c)) << "wrapping " << WrapName(c.wrap);
  // HYBRID_SHARD reduces in two levels (within, then across shard groups), a
  // different float summation order than one process: allow 3e-5 there.
  ExpectMatches(ref, got, c.strategy == ShardingStrategy::kHybridShard ? 3e-5 : 1e-5);
  // Learning happens: the last three losses are below the first three.
  EXPECT_LT(got.losses[7] + got.losses[8] + got.losses[9], got.losses[0] + got.losses[1] + got.losses[2]);
}

std::vector<ParityCase> ParityCases() {
  // Each strategy and world size runs with different wrappings across the
  // models and optimizers (the wrapping rotates), so parity covers every
  // layout, not one layout under many names.
  std::vector<ParityCase> cases;
  const Wrap wraps[] = {Wrap::kAll, Wrap::kSome, Wrap::kNone};
  int k = 0;
  for (std::string model : {"gpt", "mlp_bn"}) {
    for (std::string opt : {"sgd", "adam"}) {
      std::vector<std::pair<int, ShardingStrategy>> runs = {
          {1, ShardingStrategy::kFullShard},   {2, ShardingStrategy::kFullShard}, {4, ShardingStrategy::kFullShard},
          {2, ShardingStrategy::kShardGradOp}, {2, ShardingStrategy::kNoShard},   {4, ShardingStrategy::kHybridShard}};
      for (auto [w, strategy] : runs) cases.push_back({model, w, strategy, opt, wraps[k++ % 3]});
      ++k;  // the next optimizer starts one wrapping further
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Models, Parity, ::testing::ValuesIn(ParityCases()), [](const auto& info) {
  const auto& c = info.param;
  return c.model + "_W" + std::to_string(c.world) + "_" + ShardingStrategyName(c.strategy) + "_" + c.optimizer +
         "_wrap_" + WrapName(c.wrap);
});

// ShardingOptions::force_collectives at W=1: every unit's gather goes
// through the communicator (so the collective path, with its CUDA stream
// ordering, runs on a one-GPU machine), with results equal to the path that
// uses the shard in place.
TEST(ForceCollectives, GathersAtW1WithTheSameResults) {
  TestModel tm = shardtrain::testing::TinyGpt();
  ShardingOptions o;
  RunResult in_place = Sharded(tm, "adam", 1, o, [](torch::nn::Module&) { return WrapPolicy::Always(); });
  o.force_collectives = true;
  RunResult forced = Sharded(tm, "adam", 1, o, [](torch::nn::Module&) { return WrapPolicy::Always(); });
  EXPECT_EQ(in_place.all_gathers, 0);
  // Each unit gathers once per forward and (FULL_SHARD) once more in backward.
  EXPECT_GE(forced.all_gathers, kSteps * static_cast<int64_t>(forced.units.size()));
  ExpectMatches(in_place, forced, 0.0);
}

}  // namespace
}  // namespace shardtrain::sharding
