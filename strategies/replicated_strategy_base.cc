#include "strategies/replicated_strategy_base.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "base/errors.h"

namespace shardtrain::strategies {

void ReplicatedStrategyBase::TakeModule(std::shared_ptr<torch::nn::Module> module) {
  CheckSetUp("WrapModel");
  ST_CHECK_ARG(module != nullptr, name(), ": WrapModel needs a module");
  ST_CHECK_ARG(!module_, name(), ": WrapModel called twice");
  ApplyTruePrecision(*module);
  module_ = std::move(module);
}

c10::ScalarType ReplicatedStrategyBase::compute_dtype() const {
  return precision_ == Precision::kBf16True ? c10::ScalarType::BFloat16 : c10::ScalarType::Float;
}

std::vector<at::Tensor> ReplicatedStrategyBase::parameters() const {
  CheckWrapped("parameters()");
  return UniqueParameters(*module_);
}

std::vector<std::pair<std::string, at::Tensor>> ReplicatedStrategyBase::named_parameters() const {
  CheckWrapped("named_parameters()");
  return UniqueNamedParameters(*module_);
}

double ReplicatedStrategyBase::ClipGradNorm(double max_norm, double norm_type) {
  return ClipGradNormOnDevice(max_norm, norm_type).item<double>();
}

at::Tensor ReplicatedStrategyBase::ClipGradNormOnDevice(double max_norm, double norm_type) {
  CheckWrapped("ClipGradNorm");
  return ClipLocalGradNorm(parameters(), max_norm, norm_type);
}

std::map<std::string, at::Tensor> ReplicatedStrategyBase::FullStateDict() {
  CheckWrapped("FullStateDict");
  return ModuleStateDict(*module_);
}

void ReplicatedStrategyBase::LoadFullStateDict(const std::map<std::string, at::Tensor>& state) {
  CheckWrapped("LoadFullStateDict");
  LoadModuleStateDict(*module_, state);
}

}  // namespace shardtrain::strategies
