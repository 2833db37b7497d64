// SingleDeviceStrategy ("single_device"): one process, one device, no
// communication. The plain-training reference the distributed strategies are
// compared with. No options.
#ifndef SHARDTRAIN_STRATEGIES_SINGLE_DEVICE_SINGLE_DEVICE_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_SINGLE_DEVICE_SINGLE_DEVICE_STRATEGY_H_

#include "strategies/registry.h"
#include "strategies/replicated_strategy_base.h"

namespace shardtrain::strategies {

class SingleDeviceStrategy : public ReplicatedStrategyBase {
 public:
  std::string name() const override { return "single_device"; }
  // Throws InvalidArgumentError if `world` has more than one rank.
  void Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) override;
  void WrapModel(std::shared_ptr<torch::nn::Module> module) override { TakeModule(std::move(module)); }
  at::Tensor Forward(const std::function<at::Tensor()>& fn) override;
  void Backward(const at::Tensor& loss, bool sync_gradients = true) override;
};

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_SINGLE_DEVICE_SINGLE_DEVICE_STRATEGY_H_
