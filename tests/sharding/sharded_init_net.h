// Test models for sharded construction (sharding/sharded_init.h), shared by
// //tests/sharding:sharded_init_test and the Trainer's test of the same scope
// (//tests/trainer:trainer_features_test): wrap points with nested ones, a
// weight tied across units, a frozen parameter, root parameters.
#ifndef SHARDTRAIN_TESTS_SHARDING_SHARDED_INIT_NET_H_
#define SHARDTRAIN_TESTS_SHARDING_SHARDED_INIT_NET_H_

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "sharding/sharded_init.h"
#include "sharding/sharded_model.h"

namespace shardtrain::sharding::init_net {

constexpr int64_t kWidth = 16;

class LayerImpl : public torch::nn::Module {
 public:
  LayerImpl() {
    a = register_module("a", torch::nn::Linear(kWidth, 2 * kWidth));
    b = register_module("b", torch::nn::Linear(2 * kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& x) { return b->forward(at::relu(a->forward(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

// A unit with a nested unit, a weight tied with its sibling (so its own shard
// made at construction does not fit the unit ShardedModel builds: gathered
// back), and optionally a parameter frozen in its constructor.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const at::Tensor& shared_weight, bool with_frozen) {
    inner = register_module("inner", std::make_shared<Sharded<LayerImpl>>());
    proj = register_module("proj", torch::nn::Linear(kWidth, kWidth));
    shared = register_parameter("shared", shared_weight);
    if (with_frozen) proj->bias.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = inner->forward(x);
    return proj->forward(h) + at::matmul(h, shared) * 0.1;
  }
  std::shared_ptr<Sharded<LayerImpl>> inner;
  torch::nn::Linear proj{nullptr};
  at::Tensor shared;
};

// Root parameters (emb, the tied weight) around two wrap points with nested ones.
class NetImpl : public torch::nn::Module {
 public:
  NetImpl() {
    emb = register_module("emb", torch::nn::Linear(8, kWidth));
    at::Tensor w = register_parameter("w", at::randn({kWidth, kWidth}) * 0.2);
    b0 = register_module("b0", std::make_shared<Sharded<BlockImpl>>(w, /*with_frozen=*/true));
    b1 = register_module("b1", std::make_shared<Sharded<BlockImpl>>(w, /*with_frozen=*/false));
  }
  at::Tensor forward(const at::Tensor& x) { return b1->forward(b0->forward(emb->forward(x))).sum(1); }
  torch::nn::Linear emb{nullptr};
  std::shared_ptr<Sharded<BlockImpl>> b0, b1;
};

// Rank threads build concurrently and share the global generator: build one at
// a time, each from the same seed (construction under the scope communicates
// nothing, so this is allowed).
template <typename M>
std::shared_ptr<M> BuildLocked(uint64_t seed, const std::function<std::unique_ptr<ShardedInitScope>()>& scope) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  at::manual_seed(seed);
  auto s = scope ? scope() : nullptr;
  return std::make_shared<M>();
}

inline std::map<std::string, at::Tensor> Values(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

inline void ExpectBitEqual(const std::map<std::string, at::Tensor>& got,
                           const std::map<std::string, at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(got.at(name).equal(t)) << name << " differs";
  }
}

}  // namespace shardtrain::sharding::init_net

#endif  // SHARDTRAIN_TESTS_SHARDING_SHARDED_INIT_NET_H_
