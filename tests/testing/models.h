// Small models for sharding tests: a tiny GPT and an MLP with BatchNorm,
// each built deterministically from a seed, plus data for them.
#ifndef SHARDTRAIN_TESTS_TESTING_MODELS_H_
#define SHARDTRAIN_TESTS_TESTING_MODELS_H_

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace shardtrain::testing {

// A model under test: how to build it, make a batch and compute the loss.
struct TestModel {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> make;  // seeded inside: same weights each call
  // Batch `step` of size `batch`: inputs and targets.
  std::function<std::pair<at::Tensor, at::Tensor>(int step, int64_t batch)> data;
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)> forward;
  std::function<at::Tensor(const at::Tensor& out, const at::Tensor& target)> loss;
};

TestModel TinyGpt();
TestModel MlpWithBatchNorm();

}  // namespace shardtrain::testing

#endif  // SHARDTRAIN_TESTS_TESTING_MODELS_H_
