// Every strategy against the others on the same global batch (W=2, threads-as-ranks):
// fsdp, fsdp_native (several settings) and ddp give single_device's losses and
// parameters, with accumulation (no_sync), norm clipping, frozen and tied parameters.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/strategies/strategy_fixture.h"

namespace shardtrain::strategies {
namespace {

TEST(Parity, EveryStrategyMatchesDdp) {
  // Reference: one process on the global batch (each micro-batch in two halves,
  // as the ranks see it, so BatchNorm statistics match).
  RunResult ddp = Train("ddp", {{"bucket_cap_mb", "0.001"}}, 2);  // several buckets
  EXPECT_LT(ddp.losses.back(), ddp.losses.front());
  struct Case {
    std::string name;
    StrategyOptions opts;
  };
  std::vector<Case> cases = {
      {"fsdp_native", {}},
      {"fsdp_native", {{"sharding_strategy", "SHARD_GRAD_OP"}, {"backward_prefetch", "BACKWARD_POST"}}},
      {"fsdp_native", {{"sharding_strategy", "NO_SHARD"}}},
      {"fsdp_native", {{"auto_wrap_policy", "type:MlpBlockImpl"}, {"limit_all_gathers", "false"}}},
      {"fsdp_native_full_shard_offload", {{"forward_prefetch", "true"}}},
      {"fsdp", {}},  // min_num_params 0 (the default): every wrap point is a unit
      {"fsdp", {{"min_num_params", "100"}, {"reshard_after_forward", "false"}}},
      {"ddp_fully_sharded", {{"min_num_params", "1"}}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    RunResult got = Train(c.name, c.opts, 2);
    ExpectSame(ddp, got, 1e-5);
    EXPECT_LT(got.losses.back(), got.losses.front());
  }
}

TEST(Parity, UseOrigParamsMatchesDdpWithoutAccumulation) {
  RunResult ddp = Train("ddp", {}, 2, /*clip=*/true, /*micro=*/1);
  RunResult got = Train("fsdp_native", {{"use_orig_params", "true"}, {"auto_wrap_policy", "never"}}, 2, true, 1);
  ExpectSame(ddp, got, 1e-5);
  got = Train("fsdp_native", {{"use_orig_params", "true"}}, 2, true, 1);
  ExpectSame(ddp, got, 1e-5);
}

// use_orig_params with accumulation: the first micro-batch's backward runs
// without sync (the core's no_sync), the second reduces the sum; weights and
// losses equal DDP accumulating the same micro-batches (no_sync, then one
// all-reduce), clipped alike.
TEST(Parity, UseOrigParamsAccumulatesLikeDdp) {
  RunResult ddp = Train("ddp", {}, 2, /*clip=*/true, /*micro=*/2);
  for (const char* policy : {"never", "always"}) {
    SCOPED_TRACE(policy);
    RunResult got = Train("fsdp_native", {{"use_orig_params", "true"}, {"auto_wrap_policy", policy}}, 2, true, 2);
    ExpectSame(ddp, got, 1e-5);
  }
}

// fsdp's gradient_predivide_factor and gradient_postdivide_factor reach the
// reduce-scatter: the reduced gradient is the sum over ranks divided by both,
// so factors whose product is not the world size scale it (the default splits
// W = 2 between them: the mean).
TEST(Parity, SingleDeviceLearns) {
  // single_device at W=1 sees the whole micro-batch at once (BatchNorm over 4
  // samples instead of 2), so it is not bit-comparable; it must learn.
  RunResult r = Train("single_device", {}, 1);
  EXPECT_LT(r.losses.back(), r.losses.front());
}

// DDP: gradients are averaged by bucket all-reduces launched from the
// gradient hooks while backward still runs, and equal the mean of what each
// rank computes alone.
// ---------------------------------------------------------------------------
// Frozen and tied parameters through every strategy

// Two wrap points sharing one weight ("b0.shared" and "b1.shared" are one
// tensor), a frozen layer inside b0's unit and a frozen bias at the root.
class TieBlockImpl : public torch::nn::Module {
 public:
  TieBlockImpl(const at::Tensor& shared_weight, bool with_frozen) {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    shared = register_parameter("shared", shared_weight);
    if (with_frozen) {
      aux = register_module("aux", torch::nn::Linear(8, 8));
      for (auto& p : aux->parameters()) p.set_requires_grad(false);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = fc->forward(x) + at::matmul(x, shared);
    return at::tanh(aux ? y + aux->forward(x) : y);
  }
  torch::nn::Linear fc{nullptr}, aux{nullptr};
  at::Tensor shared;
};

class FrozenTiedNetImpl : public torch::nn::Module {
 public:
  FrozenTiedNetImpl() {
    at::manual_seed(5);
    at::Tensor w = at::randn({8, 8}) * 0.3;
    b0 = register_module("b0", std::make_shared<sharding::Sharded<TieBlockImpl>>(w, true));
    b1 = register_module("b1", std::make_shared<sharding::Sharded<TieBlockImpl>>(w, false));
    head = register_module("head", torch::nn::Linear(8, 1));
    head->bias.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(b1->forward(b0->forward(x))); }
  std::shared_ptr<sharding::Sharded<TieBlockImpl>> b0, b1;
  torch::nn::Linear head{nullptr};
};

const char* const kFrozenNames[] = {"b0.aux.weight", "b0.aux.bias", "head.bias"};

at::Tensor TieBatch(int step) { return at::randn({8, 8}, at::detail::createCPUGenerator(77 + step)); }

// AdamW with decoupled weight decay: frozen weights must not decay.
RunResult TrainFrozenTied(const std::string& name, const StrategyOptions& opts, int world) {
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(std::make_shared<FrozenTiedNetImpl>());
  RunResult result;
  std::mutex mu;
  RunRanks(world, [&](int rank, const auto& comm) {
    auto s = StrategyRegistry::Create(name, opts);
    s->Setup(name == "single_device" ? nullptr : comm::CommunicatorPtr(comm), ClusterInfo{});
    s->WrapModel(models[rank]);
    torch::optim::AdamW opt(s->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto* net = dynamic_cast<FrozenTiedNetImpl*>(&s->module());
    std::vector<double> losses;
    for (int step = 0; step < 5; ++step) {
      at::Tensor x = TieBatch(step).slice(0, rank * 8 / world, (rank + 1) * 8 / world);
      at::Tensor loss = s->Forward([&] { return net->forward(x); }).pow(2).mean();
      s->Backward(loss);
      opt.step();
      opt.zero_grad();
      losses.push_back(s->ReduceMean(loss.item<double>()));
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

TEST(Parity, FrozenAndTiedParametersThroughEveryStrategy) {
  std::map<std::string, at::Tensor> initial;
  {
    FrozenTiedNetImpl net;
    for (const auto& item : net.named_parameters()) initial[item.key()] = item.value().detach().clone();
  }
  // Plain training, each tensor stepped once (LibTorch lists a tied weight under both names).
  RunResult plain;
  {
    FrozenTiedNetImpl net;
    std::vector<at::Tensor> params;
    std::set<const void*> seen;
    for (auto& p : net.parameters()) {
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
    }
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int step = 0; step < 5; ++step) {
      at::Tensor loss = net.forward(TieBatch(step)).pow(2).mean();
      loss.backward();
      opt.step();
      opt.zero_grad();
      plain.losses.push_back(loss.item<double>());
    }
    for (const auto& item : net.named_parameters()) plain.state[item.key()] = item.value().detach().clone();
  }
  for (const char* n : kFrozenNames) ASSERT_TRUE(at::equal(plain.state.at(n), initial.at(n))) << n;
  struct Case {
    std::string name;
    StrategyOptions opts;
    int world;
  };
  const std::vector<Case> cases = {
      {"single_device", {}, 1},
      {"ddp", {}, 2},
      {"fsdp_native", {}, 2},
      {"fsdp_native", {{"sharding_strategy", "SHARD_GRAD_OP"}}, 2},
      {"fsdp_native", {{"use_orig_params", "true"}}, 2},
      {"fsdp", {{"min_num_params", "1"}}, 2},
      {"fsdp", {}, 1},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name + " W=" + std::to_string(c.world));
    RunResult got = TrainFrozenTied(c.name, c.opts, c.world);
    EXPECT_EQ(got.state.size(), plain.state.size()) << "every name of every parameter";
    ExpectSame(plain, got, 1e-5);
    for (const char* n : kFrozenNames) EXPECT_TRUE(at::equal(got.state.at(n), initial.at(n))) << "frozen " << n;
    EXPECT_TRUE(at::equal(got.state.at("b0.shared"), got.state.at("b1.shared")));
  }
}

}  // namespace
}  // namespace shardtrain::strategies
