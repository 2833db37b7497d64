// Strategy's checkpoint-state methods (strategies/strategy.h, "Checkpoint
// state"): the defaults of replicated strategies, whose every rank holds the
// whole model and the optimizer state of whole parameters. Sharded strategies
// override them (strategies/sharded_strategy_base.cc).
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <unordered_map>

#include "base/errors.h"
#include "strategies/strategy.h"

namespace shardtrain::strategies {

void Strategy::NotSharded(const char* what) const {
  ST_THROW(InvalidArgumentError, "strategy '", name(), "' is not sharded (or has no model yet): ", what,
           " needs a sharded strategy (fsdp, fsdp_native) after WrapModel");
}

void Strategy::ForEachFullStateTensor(int root, const FullStateSink& sink) {
  CheckWrapped("ForEachFullStateTensor");
  if (rank() != root) return;
  at::NoGradGuard no_grad;
  // Parameters and buffers, float32 like ModuleStateDict, each tensor stored
  // once however many names it has.
  std::unordered_map<const void*, at::Tensor> stored;
  auto add_named = [&](const std::string& name, const at::Tensor& v) {
    auto it = stored.find(v.unsafeGetTensorImpl());
    if (it == stored.end()) {
      at::Tensor t = v.detach();
      if (at::isFloatingType(t.scalar_type())) t = t.to(at::kFloat);
      it = stored.emplace(v.unsafeGetTensorImpl(), sink.add(t)).first;
    }
    sink.name(name, it->second);
  };
  for (const auto& item : module_->named_parameters(true)) add_named(item.key(), item.value());
  for (const auto& item : module_->named_buffers(true)) add_named(item.key(), item.value());
}

void Strategy::ForEachFullOptimizerState(const std::vector<at::Tensor>& params, const sharding::OptimizerStates& states,
                                         int root, const FullOptimizerStateFn& fn,
                                         std::map<std::string, int64_t>* steps) {
  if (rank() != root) return;
  std::unordered_map<const void*, std::string> names;
  for (const auto& [n, t] : named_parameters()) names[t.unsafeGetTensorImpl()] = n;
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = names.find(params[i].unsafeGetTensorImpl());
    if (!states[i] || it == names.end()) continue;
    for (const auto& [k, t] : states[i]->tensors) fn(it->second, k, t.detach());
    if (states[i]->step >= 0) (*steps)[it->second] = states[i]->step;
  }
}

std::vector<std::vector<std::string>> Strategy::OptimizedParameterNames(const std::vector<at::Tensor>& params) const {
  std::unordered_map<const void*, std::string> names;
  for (const auto& [n, t] : named_parameters()) names.emplace(t.unsafeGetTensorImpl(), n);
  std::vector<std::vector<std::string>> out;
  for (const auto& p : params) {
    auto it = names.find(p.unsafeGetTensorImpl());
    out.push_back(it == names.end() ? std::vector<std::string>{} : std::vector<std::string>{it->second});
  }
  return out;
}

sharding::OptimizerStates Strategy::OptimizerStatesFromFull(
    const std::vector<at::Tensor>& params, const std::map<std::string, std::map<std::string, at::Tensor>>& state,
    const std::map<std::string, int64_t>& step) {
  at::NoGradGuard no_grad;
  sharding::OptimizerStates out(params.size());
  std::unordered_map<const void*, std::string> names;
  for (const auto& [n, t] : named_parameters()) names[t.unsafeGetTensorImpl()] = n;
  for (size_t i = 0; i < params.size(); ++i) {
    auto nit = names.find(params[i].unsafeGetTensorImpl());
    if (nit == names.end()) continue;
    auto sit = state.find(nit->second);
    if (sit == state.end() || sit->second.empty()) continue;
    sharding::OptimizerTensorState st;
    for (const auto& [k, t] : sit->second) st.tensors[k] = t.reshape(params[i].sizes()).to(params[i].options()).clone();
    auto s = step.find(nit->second);
    st.step = s == step.end() ? -1 : s->second;
    out[i] = std::move(st);
  }
  return out;
}

sharding::ShardedStateDict Strategy::ShardedState() const { NotSharded("ShardedState"); }

std::vector<int64_t> Strategy::ShardedOptimizerSteps(const std::vector<at::Tensor>&,
                                                     const sharding::OptimizerStates&) const {
  NotSharded("ShardedOptimizerSteps");
}

std::map<std::string, at::Tensor> Strategy::ShardedOptimizerUnit(const std::vector<at::Tensor>&,
                                                                 const sharding::OptimizerStates&, int) const {
  NotSharded("ShardedOptimizerUnit");
}

std::vector<std::string> Strategy::CheckShardedState(const std::vector<sharding::ShardedStateDict>&) const {
  NotSharded("CheckShardedState");
}

void Strategy::LoadShardedState(const std::vector<sharding::ShardedStateDict>&) { NotSharded("LoadShardedState"); }

sharding::OptimizerStates Strategy::OptimizerStatesFromShards(const std::vector<at::Tensor>&,
                                                              const std::vector<sharding::ShardedStateDict>&,
                                                              const std::vector<sharding::ShardedOptimizerState>&) const {
  NotSharded("OptimizerStatesFromShards");
}

void Strategy::LoadShardsWith(const std::function<void(size_t, at::Tensor&)>&, const std::map<std::string, at::Tensor>&) {
  NotSharded("LoadShardsWith");
}

sharding::OptimizerStates Strategy::OptimizerStatesFromUnits(
    const std::vector<at::Tensor>&, const std::function<sharding::UnitShardState(size_t)>&) const {
  NotSharded("OptimizerStatesFromUnits");
}

}  // namespace shardtrain::strategies
