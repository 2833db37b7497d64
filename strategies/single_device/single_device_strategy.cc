#include "strategies/single_device/single_device_strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>

#include "base/errors.h"

namespace shardtrain::strategies {

void SingleDeviceStrategy::Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) {
  ST_CHECK_ARG(!world || world->size() == 1, "strategy 'single_device' runs one process, but the world has ",
               world->size(), " ranks; use ddp, fsdp or fsdp_native");
  Strategy::Setup(std::move(world), cluster);
}

void SingleDeviceStrategy::WrapModel(std::shared_ptr<torch::nn::Module> module) {
  CheckSetUp("WrapModel");
  ST_CHECK_ARG(module != nullptr, "single_device: WrapModel needs a module");
  ST_CHECK_ARG(!module_, "single_device: WrapModel called twice");
  ApplyTruePrecision(*module);
  module_ = std::move(module);
}

c10::ScalarType SingleDeviceStrategy::compute_dtype() const {
  return precision_ == Precision::kBf16True ? c10::ScalarType::BFloat16 : c10::ScalarType::Float;
}

at::Tensor SingleDeviceStrategy::Forward(const std::function<at::Tensor()>& fn) {
  CheckWrapped("Forward");
  return ForwardWithPrecision(fn);
}

std::vector<at::Tensor> SingleDeviceStrategy::parameters() const {
  CheckWrapped("parameters()");
  return UniqueParameters(*module_);
}

std::vector<std::pair<std::string, at::Tensor>> SingleDeviceStrategy::named_parameters() const {
  CheckWrapped("named_parameters()");
  return UniqueNamedParameters(*module_);
}

void SingleDeviceStrategy::Backward(const at::Tensor& loss, bool) {
  CheckWrapped("Backward");
  torch::autograd::backward({loss});
}

double SingleDeviceStrategy::ClipGradNorm(double max_norm, double norm_type) {
  return ClipLocalGradNorm(parameters(), max_norm, norm_type);
}

std::map<std::string, at::Tensor> SingleDeviceStrategy::FullStateDict() {
  CheckWrapped("FullStateDict");
  return ModuleStateDict(*module_);
}

void SingleDeviceStrategy::LoadFullStateDict(const std::map<std::string, at::Tensor>& state) {
  CheckWrapped("LoadFullStateDict");
  LoadModuleStateDict(*module_, state);
}

namespace {
const bool kRegistered = RegisterStrategy(
    "single_device", std::vector<OptionDoc>{}, [](const StrategyOptions&) { return std::make_shared<SingleDeviceStrategy>(); },
    "one process, no communication");
}  // namespace

}  // namespace shardtrain::strategies
