// Small models for the option tests (activation checkpointing, mixed
// precision, wrap policies, prefetch). They live in a named namespace so that
// wrap points have namespaced type names ("shardtrain::testmodels::BigImpl"),
// as user models do. Blocks call per-thread hooks (g_hooks) so that each rank
// thread observes its own model while it computes.
#ifndef SHARDTRAIN_TESTS_SHARDING_OPTION_TEST_MODELS_H_
#define SHARDTRAIN_TESTS_SHARDING_OPTION_TEST_MODELS_H_

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "sharding/wrap_point.h"

namespace shardtrain::testmodels {

using sharding::Sharded;

// What a block reports while it runs, on the calling (rank) thread.
struct BlockHooks {
  std::function<void(int id)> on_forward;       // inside forward (and its recompute under checkpointing)
  std::function<void(int id)> on_grads;         // backward reached the block's last linear (before its weight grads)
  std::function<void(int id)> on_pre_backward;  // backward reached the block's output, before its unit's pre-backward
  std::function<void(int id, const at::Tensor& mask)> on_dropout;  // the dropout mask drawn
};
inline thread_local BlockHooks g_hooks;

// Same weights on every thread: construction is serialized and seeded.
inline std::mutex& ConstructionMutex() {
  static std::mutex mu;
  return mu;
}

// in -> out: linear, tanh, times a buffer "gain" (ones). Reports through g_hooks.
class ChainBlockImpl : public torch::nn::Module {
 public:
  ChainBlockImpl(int id, int64_t in, int64_t out) : id_(id) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    gain = register_buffer("gain", at::ones({out}));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (g_hooks.on_forward) g_hooks.on_forward(id_);
    at::Tensor h = fc->forward(x);
    if (h.requires_grad() && g_hooks.on_grads) h.register_hook([id = id_](const at::Tensor&) {
      if (g_hooks.on_grads) g_hooks.on_grads(id);
    });
    at::Tensor out = at::tanh(h) * gain.to(h.scalar_type());  // buffer_dtype may differ from param_dtype
    if (out.requires_grad() && g_hooks.on_pre_backward) out.register_hook([id = id_](const at::Tensor&) {
      if (g_hooks.on_pre_backward) g_hooks.on_pre_backward(id);
    });
    return out;
  }
  int id_;
  torch::nn::Linear fc{nullptr};
  at::Tensor gain;
};

// Blocks of distinct widths (so every unit has its own flat size) and a head.
class ChainNetImpl : public torch::nn::Module {
 public:
  explicit ChainNetImpl(std::vector<int64_t> widths, uint64_t seed = 3) {
    std::lock_guard<std::mutex> lock(ConstructionMutex());
    at::manual_seed(seed);
    for (size_t i = 0; i + 1 < widths.size(); ++i) {
      b.push_back(register_module("b" + std::to_string(i),
                                  std::make_shared<Sharded<ChainBlockImpl>>(static_cast<int>(i), widths[i], widths[i + 1])));
    }
    head = register_module("head", torch::nn::Linear(widths.back(), 1));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& blk : b) x = blk->forward(x);
    return head->forward(x);
  }
  std::vector<std::shared_ptr<Sharded<ChainBlockImpl>>> b;
  torch::nn::Linear head{nullptr};
};

// A wrap point that holds wrap points: `proj` of its own and inner blocks.
class OuterChainImpl : public torch::nn::Module {
 public:
  OuterChainImpl(int64_t width, int inner_blocks) {
    for (int i = 0; i < inner_blocks; ++i) {
      inner.push_back(register_module("i" + std::to_string(i),
                                      std::make_shared<Sharded<ChainBlockImpl>>(i, width, width)));
    }
    proj = register_module("proj", torch::nn::Linear(width, width));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& blk : inner) x = blk->forward(x);
    return at::tanh(proj->forward(x));
  }
  std::vector<std::shared_ptr<Sharded<ChainBlockImpl>>> inner;
  torch::nn::Linear proj{nullptr};
};

class NestedChainNetImpl : public torch::nn::Module {
 public:
  NestedChainNetImpl(int64_t width, int inner_blocks) {
    std::lock_guard<std::mutex> lock(ConstructionMutex());
    at::manual_seed(5);
    outer = register_module("outer", std::make_shared<Sharded<OuterChainImpl>>(width, inner_blocks));
    head = register_module("head", torch::nn::Linear(width, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(outer->forward(x)); }
  std::shared_ptr<Sharded<OuterChainImpl>> outer;
  torch::nn::Linear head{nullptr};
};

// Activation checkpointing: x + fc2(dropout(gelu(fc1(x)))), an MLP whose
// intermediate activations (4x wider) are what checkpointing stops saving.
class CkptBlockImpl : public torch::nn::Module {
 public:
  CkptBlockImpl(int id, int64_t width, double dropout) : id_(id), dropout_(dropout) {
    fc1 = register_module("fc1", torch::nn::Linear(width, 4 * width));
    fc2 = register_module("fc2", torch::nn::Linear(4 * width, width));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (g_hooks.on_forward) g_hooks.on_forward(id_);
    at::Tensor h = at::gelu(fc1->forward(x));
    if (dropout_ > 0) {
      h = at::dropout(h, dropout_, is_training());
      if (g_hooks.on_dropout) g_hooks.on_dropout(id_, h.detach() == 0);
    }
    return x + at::tanh(fc2->forward(h));
  }
  int id_;
  double dropout_;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// A unit with several inputs and outputs: `scale` does not require grad and
// `shift` is not a tensor; `a` feeds on, `b` joins the loss.
class MultiIoBlockImpl : public torch::nn::Module {
 public:
  MultiIoBlockImpl(int id, int64_t width) : id_(id) {
    fc = register_module("fc", torch::nn::Linear(width, width));
    gate = register_module("gate", torch::nn::Linear(width, width));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& scale, double shift) {
    if (g_hooks.on_forward) g_hooks.on_forward(id_);
    at::Tensor a = at::tanh(fc->forward(x)) * scale + shift;
    at::Tensor b = at::sigmoid(gate->forward(x));
    return {a, b};
  }
  int id_;
  torch::nn::Linear fc{nullptr}, gate{nullptr};
};

// blocks CkptBlock units (ids 0..n-1), then a MultiIoBlock unit (id 100), then a head.
class CkptNetImpl : public torch::nn::Module {
 public:
  CkptNetImpl(int blocks, int64_t width, double dropout = 0, uint64_t seed = 9) {
    std::lock_guard<std::mutex> lock(ConstructionMutex());
    at::manual_seed(seed);
    for (int i = 0; i < blocks; ++i) {
      b.push_back(register_module("b" + std::to_string(i), std::make_shared<Sharded<CkptBlockImpl>>(i, width, dropout)));
    }
    io = register_module("io", std::make_shared<Sharded<MultiIoBlockImpl>>(100, width));
    head = register_module("head", torch::nn::Linear(width, 1));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& blk : b) x = blk->forward(x);
    at::Tensor scale = at::full({x.size(1)}, 0.5, x.options());  // no grad
    auto [a, g] = io->forward(x, scale, 0.25);
    return head->forward(a) + g.mean(1, /*keepdim=*/true);
  }
  std::vector<std::shared_ptr<Sharded<CkptBlockImpl>>> b;
  std::shared_ptr<Sharded<MultiIoBlockImpl>> io;
  torch::nn::Linear head{nullptr};
};

// Activation checkpointing of a forward returning std::vector<at::Tensor>, and
// of one it cannot handle (a struct).
class VecOutImpl : public torch::nn::Module {
 public:
  explicit VecOutImpl(int id) : id_(id) { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  std::vector<at::Tensor> forward(const at::Tensor& x) {
    if (g_hooks.on_forward) g_hooks.on_forward(id_);
    at::Tensor h = fc->forward(x);
    return {at::tanh(h), at::sigmoid(h)};
  }
  int id_;
  torch::nn::Linear fc{nullptr};
};
struct Labeled {
  at::Tensor value;
  std::string label;
};
class LabeledImpl : public torch::nn::Module {
 public:
  LabeledImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  Labeled forward(const at::Tensor& x) { return {fc->forward(x), "fc"}; }
  torch::nn::Linear fc{nullptr};
};
class VecNetImpl : public torch::nn::Module {
 public:
  VecNetImpl() {
    std::lock_guard<std::mutex> lock(ConstructionMutex());
    at::manual_seed(2);
    v = register_module("v", std::make_shared<Sharded<VecOutImpl>>(7));
    l = register_module("l", std::make_shared<Sharded<LabeledImpl>>());
  }
  at::Tensor forward(const at::Tensor& x) {
    auto outs = v->forward(x);
    return (outs[0] * outs[1]).sum();
  }
  at::Tensor forward_labeled(const at::Tensor& x) { return l->forward(x).value.sum(); }
  std::shared_ptr<Sharded<VecOutImpl>> v;
  std::shared_ptr<Sharded<LabeledImpl>> l;
};

// Wrap policies: wrap points of different sizes, one nested in another.
//   a: SmallImpl (9 params), b: BigImpl (110), c: OuterImpl (proj: 22) holding c.inner: BigImpl (110), head (3).
class SmallImpl : public torch::nn::Module {
 public:
  SmallImpl() { fc = register_module("fc", torch::nn::Linear(2, 3)); }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};
class BigImpl : public torch::nn::Module {
 public:
  BigImpl() { fc = register_module("fc", torch::nn::Linear(10, 10)); }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc->forward(x)); }
  torch::nn::Linear fc{nullptr};
};
class OuterImpl : public torch::nn::Module {
 public:
  OuterImpl() {
    inner = register_module("inner", std::make_shared<Sharded<BigImpl>>());
    proj = register_module("proj", torch::nn::Linear(10, 2));
  }
  at::Tensor forward(const at::Tensor& x) { return proj->forward(inner->forward(x)); }
  std::shared_ptr<Sharded<BigImpl>> inner;
  torch::nn::Linear proj{nullptr};
};
class WrapNetImpl : public torch::nn::Module {
 public:
  WrapNetImpl() {
    std::lock_guard<std::mutex> lock(ConstructionMutex());
    at::manual_seed(1);
    a = register_module("a", std::make_shared<Sharded<SmallImpl>>());
    b = register_module("b", std::make_shared<Sharded<BigImpl>>());
    c = register_module("c", std::make_shared<Sharded<OuterImpl>>());
    head = register_module("head", torch::nn::Linear(3, 1));
  }
  // x: [n, 10]
  at::Tensor forward(const at::Tensor& x) { return head->forward(a->forward(c->forward(b->forward(x)))); }
  std::shared_ptr<Sharded<SmallImpl>> a;
  std::shared_ptr<Sharded<BigImpl>> b;
  std::shared_ptr<Sharded<OuterImpl>> c;
  torch::nn::Linear head{nullptr};
};

}  // namespace shardtrain::testmodels

#endif  // SHARDTRAIN_TESTS_SHARDING_OPTION_TEST_MODELS_H_
