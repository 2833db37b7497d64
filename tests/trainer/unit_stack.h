// The model of the checkpoint memory tests (checkpoint_memory_test,
// sharded_memory_test): `units` equal wrap points, each a
// Sharded<BlockImpl>(dim, dim), then an unwrapped Linear(dim, classes) head
// in the root unit. Equal units make "one unit" a clear memory budget.
// Header only, like fixtures.h.
#ifndef SHARDTRAIN_TESTS_TRAINER_UNIT_STACK_H_
#define SHARDTRAIN_TESTS_TRAINER_UNIT_STACK_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <vector>

#include "sharding/sharded_model.h"
#include "tests/trainer/fixtures.h"

namespace shardtrain::trainer::fixtures {

class UnitStack : public torch::nn::Module {
 public:
  // With a generator, every parameter is drawn from it times `scale`, in
  // registration order, inside the constructors (DrawParameters).
  UnitStack(int units, int64_t dim, int64_t classes, at::Generator* g = nullptr, double scale = 1.0) {
    for (int i = 0; i < units; ++i) {
      blocks.push_back(
          register_module("b" + std::to_string(i), std::make_shared<sharding::Sharded<BlockImpl>>(dim, dim, g, scale)));
    }
    head = register_module("head", torch::nn::Linear(dim, classes));
    DrawParameters(*head, g, scale);
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b->forward(x);
    return head->forward(x);
  }
  std::vector<std::shared_ptr<sharding::Sharded<BlockImpl>>> blocks;
  torch::nn::Linear head{nullptr};
};

}  // namespace shardtrain::trainer::fixtures

#endif  // SHARDTRAIN_TESTS_TRAINER_UNIT_STACK_H_
