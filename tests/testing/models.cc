#include "tests/testing/models.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

#include "examples/gpt/gpt_model.h"
#include "sharding/wrap_point.h"

namespace shardtrain::testing {
namespace {

at::Generator Gen(uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return g;
}

class MlpBlockImpl : public torch::nn::Module {
 public:
  MlpBlockImpl(int64_t in, int64_t out) {
    // No bias before BatchNorm (it would cancel out and only carry rounding noise).
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm1d(out));
  }
  at::Tensor forward(const at::Tensor& x) { return at::relu(bn->forward(fc->forward(x))); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl() {
    b1 = register_module("b1", std::make_shared<sharding::Sharded<MlpBlockImpl>>(12, 24));
    b2 = register_module("b2", std::make_shared<sharding::Sharded<MlpBlockImpl>>(24, 24));
    head = register_module("head", torch::nn::Linear(24, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(b2->forward(b1->forward(x))); }
  std::shared_ptr<sharding::Sharded<MlpBlockImpl>> b1, b2;
  torch::nn::Linear head{nullptr};
};

}  // namespace

TestModel TinyGpt() {
  TestModel m;
  m.name = "gpt";
  examples::GptConfig c;
  c.vocab_size = 29;
  c.block_size = 12;
  c.n_layer = 3;
  c.n_head = 2;
  c.n_embd = 16;
  m.make = [c] {
    at::manual_seed(1234);
    return std::static_pointer_cast<torch::nn::Module>(std::make_shared<examples::GptImpl>(c));
  };
  m.data = [c](int step, int64_t batch) {
    auto g = Gen(100 + step);
    // Learnable: each sequence counts up by a per-sequence stride from a random start.
    at::Tensor start = at::randint(c.vocab_size, {batch, 1}, g, at::kLong);
    at::Tensor stride = at::randint(1, 4, {batch, 1}, g, at::kLong);
    at::Tensor seq = (start + stride * at::arange(c.block_size + 1, at::kLong)).remainder(c.vocab_size);
    return std::make_pair(seq.slice(1, 0, c.block_size), seq.slice(1, 1, c.block_size + 1));
  };
  m.forward = [](torch::nn::Module& mod, const at::Tensor& x) {
    return static_cast<examples::GptImpl&>(mod).forward(x);
  };
  m.loss = [](const at::Tensor& out, const at::Tensor& y) { return examples::GptImpl::Loss(out, y); };
  return m;
}

TestModel MlpWithBatchNorm() {
  TestModel m;
  m.name = "mlp_bn";
  m.make = [] {
    at::manual_seed(4321);
    return std::static_pointer_cast<torch::nn::Module>(std::make_shared<MlpImpl>());
  };
  m.data = [](int step, int64_t batch) {
    auto g = Gen(200 + step);
    at::Tensor x = at::randn({batch, 12}, g);
    at::Tensor y = x.slice(1, 0, 5).argmax(1);  // learnable: the largest of the first five features
    return std::make_pair(x, y);
  };
  m.forward = [](torch::nn::Module& mod, const at::Tensor& x) { return static_cast<MlpImpl&>(mod).forward(x); };
  m.loss = [](const at::Tensor& out, const at::Tensor& y) { return at::cross_entropy_loss(out.to(at::kFloat), y); };
  return m;
}

}  // namespace shardtrain::testing
