// ProbeNet: a model of ProbeBlocks that report, while they compute, the bytes
// the model's parameters really occupy (the sharded tests' memory probe).
#ifndef SHARDTRAIN_TESTS_SHARDING_PROBE_NET_H_
#define SHARDTRAIN_TESTS_SHARDING_PROBE_NET_H_

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "sharding/wrap_point.h"

namespace shardtrain::sharding {

// A block that reports, while it computes, the bytes its model's parameters
// really occupy (distinct parameter storages, by their allocated size).
inline thread_local std::function<void(int)> g_probe;  // per rank thread

class ProbeBlockImpl : public torch::nn::Module {
 public:
  ProbeBlockImpl(int id, int64_t width) : id_(id) { fc = register_module("fc", torch::nn::Linear(width, width)); }
  at::Tensor forward(const at::Tensor& x) {
    if (g_probe) g_probe(id_);
    return at::tanh(fc->forward(x));
  }
  int id_;
  torch::nn::Linear fc{nullptr};
};

class ProbeNetImpl : public torch::nn::Module {
 public:
  explicit ProbeNetImpl(int blocks, int64_t width = 64) {
    static std::mutex mu;  // rank threads build models concurrently: same seed, same weights
    std::lock_guard<std::mutex> lock(mu);
    at::manual_seed(7);
    for (int i = 0; i < blocks; ++i) {
      b.push_back(register_module("b" + std::to_string(i), std::make_shared<Sharded<ProbeBlockImpl>>(i, width)));
    }
    head = register_module("head", torch::nn::Linear(width, 1));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& blk : b) x = blk->forward(x);
    return head->forward(x);
  }
  std::vector<std::shared_ptr<Sharded<ProbeBlockImpl>>> b;
  torch::nn::Linear head{nullptr};
};

}  // namespace shardtrain::sharding

#endif  // SHARDTRAIN_TESTS_SHARDING_PROBE_NET_H_
