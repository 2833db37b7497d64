#include "trainer/connectors/internal/optimizer_ownership.h"

#include <torch/optim/optimizer.h>

#include <string>
#include <unordered_set>

#include "base/errors.h"

namespace shardtrain::trainer::internal {

int64_t CountForeignParameters(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& owned) {
  std::unordered_set<const c10::TensorImpl*> mine;
  for (const auto& t : owned) mine.insert(t.unsafeGetTensorImpl());
  int64_t foreign = 0;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      if (!mine.count(p.unsafeGetTensorImpl())) ++foreign;
    }
  }
  return foreign;
}

void CheckOptimizerOwnsParameters(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& owned,
                                  const std::string& strategy_name) {
  const int64_t foreign = CountForeignParameters(opt, owned);
  if (foreign == 0) return;
  int64_t total = 0;
  for (const auto& group : opt.param_groups()) total += static_cast<int64_t>(group.params().size());
  ST_THROW(InvalidArgumentError, "configure_optimizers returned an optimizer over ", foreign, " of ", total,
           " tensor(s) that strategy '", strategy_name,
           "' does not train (it would step tensors that never get a gradient, and the model would not learn). "
           "Build the optimizer from the `params` handed to configure_optimizers (the strategy's parameters(): "
           "shards for fsdp/fsdp_native), not from module->parameters() captured before wrapping or from other "
           "tensors");
}

}  // namespace shardtrain::trainer::internal
