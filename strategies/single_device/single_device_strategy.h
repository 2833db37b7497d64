// SingleDeviceStrategy ("single_device"): one process, one device, no
// communication. The plain-training reference the distributed strategies are
// compared with. No options.
#ifndef SHARDTRAIN_STRATEGIES_SINGLE_DEVICE_SINGLE_DEVICE_STRATEGY_H_
#define SHARDTRAIN_STRATEGIES_SINGLE_DEVICE_SINGLE_DEVICE_STRATEGY_H_

#include "strategies/registry.h"
#include "strategies/strategy.h"

namespace shardtrain::strategies {

class SingleDeviceStrategy : public Strategy {
 public:
  std::string name() const override { return "single_device"; }
  // Throws InvalidArgumentError if `world` has more than one rank.
  void Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) override;
  void WrapModel(std::shared_ptr<torch::nn::Module> module) override;
  c10::ScalarType compute_dtype() const override;
  at::Tensor Forward(const std::function<at::Tensor()>& fn) override;
  std::vector<at::Tensor> parameters() const override;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const override;
  void Backward(const at::Tensor& loss, bool sync_gradients = true) override;
  double ClipGradNorm(double max_norm, double norm_type = 2.0) override;
  std::map<std::string, at::Tensor> FullStateDict() override;
  void LoadFullStateDict(const std::map<std::string, at::Tensor>& state) override;
};

}  // namespace shardtrain::strategies

#endif  // SHARDTRAIN_STRATEGIES_SINGLE_DEVICE_SINGLE_DEVICE_STRATEGY_H_
