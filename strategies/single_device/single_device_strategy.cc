#include "strategies/single_device/single_device_strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "base/errors.h"

namespace shardtrain::strategies {

void SingleDeviceStrategy::Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) {
  ST_CHECK_ARG(!world || world->size() == 1, "strategy 'single_device' runs one process, but the world has ",
               world->size(), " ranks; use ddp, fsdp or fsdp_native");
  Strategy::Setup(std::move(world), cluster);
}

at::Tensor SingleDeviceStrategy::Forward(const std::function<at::Tensor()>& fn) {
  CheckWrapped("Forward");
  return ForwardWithPrecision(fn);
}

void SingleDeviceStrategy::Backward(const at::Tensor& loss, bool) {
  CheckWrapped("Backward");
  torch::autograd::backward({loss});
}

namespace {
const bool kRegistered = RegisterStrategy(
    "single_device", std::vector<OptionDoc>{}, [](const StrategyOptions&) { return std::make_shared<SingleDeviceStrategy>(); },
    "one process, no communication");
}  // namespace

}  // namespace shardtrain::strategies
