// Internal to //trainer: the check that an optimizer steps the tensors the
// strategy trains. A sharded strategy trains its shards, not the module's
// original parameters, so an optimizer built over module->parameters()
// captured before WrapModel (or over unrelated tensors) would step tensors
// no gradient ever reaches: training would silently do nothing.
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_OPTIMIZER_OWNERSHIP_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_OPTIMIZER_OWNERSHIP_H_

#include <ATen/core/Tensor.h>

#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer::internal {

// How many of the optimizer's parameters (over all groups) are not among
// `owned` (compared by TensorImpl identity, so views or copies do not count).
int64_t CountForeignParameters(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& owned);

// Throws InvalidArgumentError when CountForeignParameters is not 0, naming
// how many of how many tensors are foreign, the strategy, and what to do.
void CheckOptimizerOwnsParameters(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& owned,
                                  const std::string& strategy_name);

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_OPTIMIZER_OWNERSHIP_H_
