// ReplicatedStrategyBase: what the strategies that hold the whole model on
// every rank (ddp, single_device) share — the module as given (cast to
// bfloat16 for "bf16-true"), its own parameters, clipping over them, and its
// state dict. Each derived strategy adds how gradients are synchronised.
// Not for direct use.
#ifndef SHARDTRAIN_STRATEGIES_REPLICATED_STRATEGY_BASE_H_
#define SHARDTRAIN_STRATEGIES_REPLICATED_STRATEGY_BASE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "strategies/strategy.h"

namespace shardtrain::strategies {

class ReplicatedStrategyBase : public Strategy {
 public:
  // bfloat16 with "bf16-true" (the module itself is cast), else float32.
  c10::ScalarType compute_dtype() const override;
  std::vector<at::Tensor> parameters() const override;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const override;
  // By global norm over this rank's (complete, synchronised) gradients.
  double ClipGradNorm(double max_norm, double norm_type = 2.0) override;
  at::Tensor ClipGradNormOnDevice(double max_norm, double norm_type = 2.0) override;
  std::map<std::string, at::Tensor> FullStateDict() override;
  void LoadFullStateDict(const std::map<std::string, at::Tensor>& state) override;

 protected:
  ReplicatedStrategyBase() = default;
  // WrapModel's common part: checks the call, applies "bf16-true" and keeps
  // the module.
  void TakeModule(std::shared_ptr<torch::nn::Module> module);
};

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_REPLICATED_STRATEGY_BASE_H_
