// Models the sharding core was not designed around: frozen parameters that
// share a unit with trainable ones, and one weight registered in several wrap
// points (tied weights). Sharded training must equal plain single-process
// training on the same global batch, frozen weights must never change.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "sharding/sharded_model.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::sharding {
namespace {

using shardtrain::testing::RunRanks;
constexpr int64_t kWidth = 16;

// A block with its own layer, a weight it shares with its sibling (registered
// in both: "b0.shared" and "b1.shared" are one tensor), and optionally a
// frozen layer in the same unit.
class TiedBlockImpl : public torch::nn::Module {
 public:
  TiedBlockImpl(const at::Tensor& shared_weight, bool with_frozen) {
    fc = register_module("fc", torch::nn::Linear(kWidth, kWidth));
    shared = register_parameter("shared", shared_weight);
    if (with_frozen) aux = register_module("aux", torch::nn::Linear(kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = fc->forward(x) + at::matmul(x, shared);
    if (aux) y = y + aux->forward(x);
    return at::tanh(y);
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::Linear aux{nullptr};
  at::Tensor shared;
};

// A wrap point holding two wrap points that share a weight: the tied weight
// belongs to this unit (their lowest common ancestor), not to either child.
class StackImpl : public torch::nn::Module {
 public:
  StackImpl() {
    at::Tensor w = at::randn({kWidth, kWidth}) * 0.2;
    b0 = register_module("b0", std::make_shared<Sharded<TiedBlockImpl>>(w, /*with_frozen=*/true));
    b1 = register_module("b1", std::make_shared<Sharded<TiedBlockImpl>>(w, /*with_frozen=*/false));
    gate = register_parameter("gate", at::ones({kWidth}));
  }
  at::Tensor forward(const at::Tensor& x) { return b1->forward(b0->forward(x)) * gate; }
  std::shared_ptr<Sharded<TiedBlockImpl>> b0, b1;
  at::Tensor gate;
};

class NetImpl : public torch::nn::Module {
 public:
  // `with_unused`: a root layer that only steps with use_extra set use.
  explicit NetImpl(bool with_unused = false) {
    static std::mutex mu;  // rank threads build models concurrently: same seed, same weights
    std::lock_guard<std::mutex> lock(mu);
    at::manual_seed(11);
    stack = register_module("stack", std::make_shared<Sharded<StackImpl>>());
    head = register_module("head", torch::nn::Linear(kWidth, 1));
    // Frozen: a whole layer inside a unit with trainable ones, and a bias at the root.
    for (auto& p : stack->b0->aux->parameters()) p.set_requires_grad(false);
    head->bias.set_requires_grad(false);
    if (with_unused) extra = register_module("extra", torch::nn::Linear(kWidth, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = head->forward(stack->forward(x));
    return extra && use_extra ? y + extra->forward(x) : y;
  }
  std::shared_ptr<Sharded<StackImpl>> stack;
  torch::nn::Linear head{nullptr};
  torch::nn::Linear extra{nullptr};
  bool use_extra = true;
};

const std::set<std::string> kFrozen = {"stack.b0.aux.weight", "stack.b0.aux.bias", "head.bias"};

at::Tensor Batch(int step) {
  at::Generator g = at::detail::createCPUGenerator(1000 + step);
  return at::randn({8, kWidth}, g);
}

enum class Opt { kAdamW, kAdamL2, kSgdMomentum };
const char* OptName(Opt o) { return o == Opt::kAdamW ? "AdamW" : o == Opt::kAdamL2 ? "Adam+L2" : "SGD+momentum"; }

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(Opt o, const std::vector<at::Tensor>& params) {
  switch (o) {
    case Opt::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    case Opt::kAdamL2:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
    case Opt::kSgdMomentum:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.1));
  }
  return nullptr;
}

using State = std::map<std::string, at::Tensor>;

State Snapshot(torch::nn::Module& m) {
  State out;
  for (const auto& item : m.named_parameters(true)) out[item.key()] = item.value().detach().clone();
  return out;
}

// Plain single-process training on the full batch: each tensor stepped once
// (LibTorch lists a tied weight under both names), frozen ones left out.
State TrainPlain(Opt o, int steps, std::vector<double>* losses) {
  auto net = std::make_shared<NetImpl>();
  std::vector<at::Tensor> trainable;
  std::set<const void*> seen;
  for (auto& p : net->parameters()) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) trainable.push_back(p);
  }
  auto opt = MakeOptimizer(o, trainable);
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    at::Tensor loss = net->forward(Batch(s)).pow(2).mean();
    loss.backward();
    opt->step();
    if (losses) losses->push_back(loss.item<double>());
  }
  return Snapshot(*net);
}

struct ShardedRun {
  State full;  // rank 0's full state dict
  std::vector<double> losses;  // mean over ranks of the local losses
  std::vector<UnitInfo> units;
};

// `shared_memory`: the ranks' communicators exchange through shared memory
// (the default; gradients are then reduce-scattered where autograd left them)
// or through Gloo's TCP (each gradient collected into a flat buffer first).
// `with_unused`: the net has a layer that gets no gradient on odd steps.
ShardedRun TrainSharded(int world, ShardingOptions options, Opt o, int steps, bool shared_memory = true,
                        bool with_unused = false) {
  ShardedRun run;
  std::mutex mu;
  std::vector<std::vector<double>> rank_losses(world);
  auto gloo_options = [shared_memory](int) {
    comm::GlooOptions g;
    g.shared_memory = shared_memory;
    return g;
  };
  shardtrain::testing::RunRanksWithOptions(world, gloo_options, [&](int rank, const auto& comm) {
    auto net = std::make_shared<NetImpl>(with_unused);
    ShardedModel sm(net, comm, options);
    auto opt = MakeOptimizer(o, sm.parameters());
    const int64_t per = 8 / world;
    for (int s = 0; s < steps; ++s) {
      net->use_extra = s % 2 == 0;
      opt->zero_grad();
      at::Tensor x = Batch(s).slice(0, rank * per, (rank + 1) * per);
      at::Tensor loss = sm.Forward([&] { return net->forward(x); }).pow(2).mean();
      loss.backward();
      opt->step();
      rank_losses[rank].push_back(loss.item<double>());
    }
    auto full = sm.FullStateDict(true);
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) {
      run.full = full;
      run.units = sm.units();
    }
  });
  for (int s = 0; s < steps; ++s) {
    double sum = 0;
    for (int r = 0; r < world; ++r) sum += rank_losses[r][s];
    run.losses.push_back(sum / world);
  }
  return run;
}

void ExpectMatchesPlain(const State& got, const State& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what << ": the full state dict must hold every name of every parameter";
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": missing " << name;
    const double err = (it->second - w).abs().max().item<double>();
    EXPECT_LE(err, tol * (1 + w.abs().max().item<double>())) << what << ": " << name;
  }
}

TEST(FrozenParameters, StayBitIdenticalWithEveryOptimizerAndWorldSize) {
  const auto initial = Snapshot(*std::make_shared<NetImpl>());
  for (Opt o : {Opt::kAdamW, Opt::kAdamL2, Opt::kSgdMomentum}) {
    const State want = TrainPlain(o, 5, nullptr);
    for (const auto& name : kFrozen) ASSERT_TRUE(at::equal(want.at(name), initial.at(name))) << name;
    for (int world : {1, 2, 4}) {
      for (bool orig : {false, true}) {
        ShardingOptions options;
        options.use_orig_params = orig;
        const std::string what = std::string(OptName(o)) + " W=" + std::to_string(world) +
                                 (orig ? " use_orig_params" : "");
        ShardedRun run = TrainSharded(world, options, o, 5);
        for (const auto& name : kFrozen) {
          EXPECT_TRUE(at::equal(run.full.at(name), initial.at(name))) << what << ": frozen " << name << " changed";
        }
        ExpectMatchesPlain(run.full, want, 1e-5, what);
      }
    }
  }
}

// Gradients reduce-scattered where autograd left them (shared memory: frozen
// parameters, a layer unused on odd steps and the padding filled with zeros
// pieces) give the bits of gradients collected into one flat buffer and
// reduce-scattered over TCP; the weights and the losses are identical.
TEST(FrozenParameters, GradientsReducedInPlaceEqualThoseCollectedInAFlatBuffer) {
  for (int world : {2, 3}) {
    for (bool orig : {false, true}) {
      ShardingOptions options;
      options.use_orig_params = orig;
      const std::string what = "W=" + std::to_string(world) + (orig ? " use_orig_params" : "");
      const ShardedRun in_place = TrainSharded(world, options, Opt::kSgdMomentum, 4, /*shared_memory=*/true, true);
      const ShardedRun flat = TrainSharded(world, options, Opt::kSgdMomentum, 4, /*shared_memory=*/false, true);
      ASSERT_EQ(in_place.full.size(), flat.full.size()) << what;
      for (const auto& [name, t] : flat.full) {
        EXPECT_TRUE(at::equal(in_place.full.at(name), t)) << what << ": " << name;
      }
      EXPECT_EQ(in_place.losses, flat.losses) << what;
    }
  }
}

TEST(FrozenParameters, OptimizerSeesOnlyTheTrainablePartOfAMixedUnit) {
  RunRanks(2, [&](int rank, const auto& comm) {
    auto net = std::make_shared<NetImpl>();
    ShardedModel sm(net, comm, {});
    int64_t optimized = 0;
    for (const auto& p : sm.parameters()) optimized += p.numel();
    int64_t trainable = 0, all = 0;
    std::set<const void*> seen;
    for (const auto& p : net->parameters()) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      all += p.numel();
      if (p.requires_grad()) trainable += p.numel();
    }
    // Summed over both ranks the optimizer steps exactly the trainable elements.
    at::Tensor total = at::full({1}, static_cast<double>(optimized), at::kDouble);
    comm->AllReduce(total, {comm::ReduceOp::kSum})->Wait();
    EXPECT_EQ(total.item<double>(), static_cast<double>(trainable));
    EXPECT_LT(trainable, all);
    // Within the unit of b0, trainable parameters come first, frozen ones last.
    for (const auto& u : sm.units()) {
      if (u.name != "stack.b0") continue;
      EXPECT_EQ(u.param_names, (std::vector<std::string>{"stack.b0.fc.weight", "stack.b0.fc.bias",
                                                         "stack.b0.aux.weight", "stack.b0.aux.bias"}));
    }
  });
}

TEST(TiedWeights, LiveInTheLowestCommonUnitAndTrainLikePlainTraining) {
  std::vector<double> want_losses;
  const State want = TrainPlain(Opt::kAdamW, 6, &want_losses);
  ASSERT_EQ(want.count("stack.b1.shared"), 1u);
  struct Case {
    ShardingStrategy strategy;
    int world;
    bool orig = false;
  };
  const std::vector<Case> cases = {
      {ShardingStrategy::kFullShard, 1},   {ShardingStrategy::kFullShard, 2},   {ShardingStrategy::kFullShard, 4},
      {ShardingStrategy::kShardGradOp, 2}, {ShardingStrategy::kNoShard, 2},     {ShardingStrategy::kHybridShard, 4},
      {ShardingStrategy::kFullShard, 2, true}};
  for (const auto& c : cases) {
    ShardingOptions options;
    options.sharding_strategy = c.strategy;
    options.use_orig_params = c.orig;
    if (c.strategy == ShardingStrategy::kHybridShard) options.hybrid_shard_group_size = 2;
    const std::string what = std::string(ShardingStrategyName(c.strategy)) + " W=" + std::to_string(c.world) +
                             (c.orig ? " use_orig_params" : "");
    ShardedRun run = TrainSharded(c.world, options, Opt::kAdamW, 6);
    // The tied weight is one parameter of the unit that encloses both users.
    bool found = false;
    for (const auto& u : run.units) {
      const bool has = std::find(u.param_names.begin(), u.param_names.end(), "stack.b0.shared") != u.param_names.end();
      if (has) {
        EXPECT_EQ(u.name, "stack") << what;
      }
      found = found || has;
      EXPECT_EQ(std::count(u.param_names.begin(), u.param_names.end(), "stack.b1.shared"), 0) << what;
    }
    EXPECT_TRUE(found) << what;
    const double tol = c.strategy == ShardingStrategy::kHybridShard ? 3e-5 : 1e-5;
    ExpectMatchesPlain(run.full, want, tol, what);
    EXPECT_TRUE(at::equal(run.full.at("stack.b0.shared"), run.full.at("stack.b1.shared"))) << what;
    for (size_t s = 0; s < want_losses.size(); ++s) {
      EXPECT_NEAR(run.losses[s], want_losses[s], tol * (1 + std::abs(want_losses[s]))) << what << " step " << s;
    }
  }
}

TEST(TiedWeights, StateDictsRoundTripUnderEveryName) {
  RunRanks(2, [&](int rank, const auto& comm) {
    auto net = std::make_shared<NetImpl>();
    ShardedModel sm(net, comm, {});
    State full = sm.FullStateDict(/*rank0_only=*/false);
    EXPECT_EQ(full.size(), Snapshot(*std::make_shared<NetImpl>()).size());
    // Loading with the tied copies disagreeing is refused, naming both names.
    State bad = full;
    bad["stack.b1.shared"] = bad["stack.b1.shared"] + 1;
    try {
      sm.LoadFullStateDict(bad);
      ADD_FAILURE() << "disagreeing tied values were loaded";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("stack.b1.shared"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("stack.b0.shared"), std::string::npos) << e.what();
    }
    // A state dict with only the first name loads too (sharded checkpoints keep one name).
    State one = full;
    one.erase("stack.b1.shared");
    one["stack.b0.shared"] = one["stack.b0.shared"] * 0.5;
    sm.LoadFullStateDict(one);
    State back = sm.FullStateDict(false);
    EXPECT_TRUE(at::equal(back.at("stack.b1.shared"), one.at("stack.b0.shared")));
  });
}

}  // namespace
}  // namespace shardtrain::sharding
