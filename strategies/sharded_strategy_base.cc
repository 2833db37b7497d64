#include "strategies/sharded_strategy_base.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>

#include <cmath>
#include <sstream>

#include "base/errors.h"
#include "base/logging.h"
#include "sharding/optimizer_state.h"
#include "sharding/sharded_init.h"

namespace shardtrain::strategies {

ShardedStrategyBase::~ShardedStrategyBase() = default;

sharding::MixedPrecision ShardedStrategyBase::PrecisionToMixed(Precision precision) {
  sharding::MixedPrecision mp;
  if (precision == Precision::kBf16Mixed) {
    mp.param_dtype = mp.reduce_dtype = mp.buffer_dtype = at::kBFloat16;
  } else if (precision == Precision::k16Mixed) {
    mp.param_dtype = mp.reduce_dtype = mp.buffer_dtype = at::kHalf;
  }
  return mp;
}

void ShardedStrategyBase::SetPrecision(const std::string& precision) {
  ST_CHECK_ARG(ParsePrecision(precision) != Precision::kBf16True, "strategy '", name(),
               "': precision 'bf16-true' would keep the parameters themselves and the optimizer state in bfloat16, "
               "with no float32 master copy; sharded strategies always keep float32 master shards, so they do not "
               "offer it. Use precision 'bf16-mixed' (bfloat16 compute and communication, float32 master shards), "
               "or bf16-true with a replicated strategy (ddp, single_device)");
  Strategy::SetPrecision(precision);
}

sharding::ShardingOptions ShardedStrategyBase::ResolvedShardingOptions() const {
  if (sm_) return sharding_options_;
  sharding::ShardingOptions options = sharding_options_;
  PrepareOptions(options);
  options.offload_params = !offload_requested_by_.empty() && device_.is_cuda();
  return options;
}

void ShardedStrategyBase::WrapModel(std::shared_ptr<torch::nn::Module> module) {
  CheckSetUp("WrapModel");
  ST_CHECK_ARG(module != nullptr, name(), ": WrapModel needs a module");
  ST_CHECK_ARG(!sm_, name(), ": WrapModel called twice");
  ST_CHECK_ARG(world_ != nullptr, name(), ": needs a communicator (Setup with a world group; size 1 is fine)");
  sharding::ShardingOptions options = ResolvedShardingOptions();
  if (!offload_requested_by_.empty() && !options.offload_params && rank() == 0) {
    ST_LOG(INFO) << name() << ": " << offload_requested_by_ << " asks for CPU offload, which stays off: the model "
                 << "computes on " << device_ << ", so its parameters already live in host memory";
  }
  sharding_options_ = options;
  sm_ = std::make_unique<sharding::ShardedModel>(module, ShardingWorld(), options, policy_, checkpoint_,
                                                 cluster_.local_world_size);
  module_ = std::move(module);
}

namespace {
class InitScopeHolder : public Strategy::ConstructionScope {
 public:
  InitScopeHolder(sharding::ShardGroupPlace place, sharding::WrapPolicy policy) : scope_(place, std::move(policy)) {}

 private:
  sharding::ShardedInitScope scope_;
};
}  // namespace

std::unique_ptr<Strategy::ConstructionScope> ShardedStrategyBase::MakeConstructionScope() {
  CheckSetUp("MakeConstructionScope");
  // On any device: the model is built on the CPU shard by shard and moved
  // shard by shard (sharding::ShardedInitScope::MoveToDevice, the Trainer).
  if (!sharded_construction_ || sm_ || world_ == nullptr) return nullptr;
  const comm::CommunicatorPtr group = ShardingWorld();
  const int group_rank = group ? group->rank() : 0, group_size = group ? group->size() : 1;
  const auto place =
      sharding::ShardGroupOf(group_rank, group_size, ResolvedShardingOptions(), cluster_.local_world_size);
  // A shard group of one at W > 1 (NO_SHARD) keeps whole parameters anyway;
  // at W = 1 the scope still flattens unit by unit, so construction never
  // holds the model twice (the plain path copies it into the flat parameters).
  if (place.size == 1 && group_size > 1) return nullptr;
  return std::make_unique<InitScopeHolder>(place, policy_);
}

sharding::ShardedModel& ShardedStrategyBase::sharded_model() {
  CheckWrapped("sharded_model()");
  return *sm_;
}

c10::ScalarType ShardedStrategyBase::compute_dtype() const {
  return sm_ ? sm_->compute_dtype() : sharding_options_.mixed_precision.param_dtype.value_or(at::kFloat);
}

at::Tensor ShardedStrategyBase::Forward(const std::function<at::Tensor()>& fn) {
  CheckWrapped("Forward");
  return sm_->Forward(fn);
}

std::vector<at::Tensor> ShardedStrategyBase::parameters() const {
  CheckWrapped("parameters()");
  return sm_->parameters();
}

std::vector<std::pair<std::string, at::Tensor>> ShardedStrategyBase::named_parameters() const {
  CheckWrapped("named_parameters()");
  return sm_->named_parameters();
}

void ShardedStrategyBase::Backward(const at::Tensor& loss, bool sync_gradients) {
  CheckWrapped("Backward");
  if (sync_gradients) {
    torch::autograd::backward({loss});
  } else {
    auto scope = sm_->no_sync();
    torch::autograd::backward({loss});
  }
}

double ShardedStrategyBase::ClipGradNorm(double max_norm, double norm_type) {
  return ClipGradNormOnDevice(max_norm, norm_type).item<double>();
}

at::Tensor ShardedStrategyBase::ClipGradNormOnDevice(double max_norm, double norm_type) {
  CheckWrapped("ClipGradNorm");
  if (!sharding_options_.use_orig_params) return sm_->ClipGradNormOnDevice(max_norm, norm_type);
  // With use_orig_params the optimizer steps per-parameter views of the shard
  // whose .grad tensors need not alias the flat shard gradient (zero_grad sets
  // them to None), so ShardedModel::ClipGradNorm (flat gradients) would clip
  // what the optimizer does not see. Clip the views' gradients: they are
  // disjoint pieces of this rank's shard, so summing over the shard group
  // gives the unsharded norm.
  return ClipLocalGradNorm(sm_->parameters(), max_norm, norm_type, sm_->shard_group());
}

std::map<std::string, at::Tensor> ShardedStrategyBase::FullStateDict() {
  CheckWrapped("FullStateDict");
  return sm_->FullStateDict(/*rank0_only=*/true, /*to_cpu=*/true);
}

void ShardedStrategyBase::LoadFullStateDict(const std::map<std::string, at::Tensor>& state) {
  CheckWrapped("LoadFullStateDict");
  sm_->LoadFullStateDict(state);
}

void ShardedStrategyBase::ForEachFullStateTensor(int root, const FullStateSink& sink) {
  CheckWrapped("ForEachFullStateTensor");
  at::NoGradGuard no_grad;
  // Parameters, one unit at a time; a tied weight's names share one record
  // (ForEachFullUnit gives its names one after another, as the same tensor).
  at::Tensor last_full, last_stored;
  sm_->ForEachFullUnit(nullptr, root, [&](const std::string& name, const at::Tensor& full) {
    if (!last_full.defined() || !last_full.is_same(full)) {
      last_full = full;
      last_stored = sink.add(full);
    }
    sink.name(name, last_stored);
  });
  last_full = last_stored = at::Tensor();
  if (rank() != root) return;
  for (const auto& item : module_->named_buffers(true)) {
    at::Tensor b = item.value().detach();
    if (at::isFloatingType(b.scalar_type())) b = b.to(at::kFloat);
    sink.name(item.key(), sink.add(b));
  }
}

void ShardedStrategyBase::ForEachFullOptimizerState(const std::vector<at::Tensor>& params,
                                                    const sharding::OptimizerStates& states, int root,
                                                    const FullOptimizerStateFn& fn,
                                                    std::map<std::string, int64_t>* steps) {
  CheckWrapped("ForEachFullOptimizerState");
  sharding::ForEachFullOptimizerState(*sm_, params, states, root, fn, steps);
}

std::vector<std::vector<std::string>> ShardedStrategyBase::OptimizedParameterNames(
    const std::vector<at::Tensor>& params) const {
  CheckWrapped("OptimizedParameterNames");
  return sharding::OptimizedParameterNames(*sm_, params);
}

sharding::OptimizerStates ShardedStrategyBase::OptimizerStatesFromFull(
    const std::vector<at::Tensor>& params, const std::map<std::string, std::map<std::string, at::Tensor>>& state,
    const std::map<std::string, int64_t>& step) {
  CheckWrapped("OptimizerStatesFromFull");
  return sharding::OptimizerStatesFromFull(*sm_, params, state, step);
}

std::vector<Strategy::UnitSummary> ShardedStrategyBase::UnitSummaries() const {
  CheckWrapped("UnitSummaries");
  std::map<std::string, at::Tensor> by_name;  // requires_grad and sizes are metadata: safe while resharded
  for (const auto& item : module_->named_parameters(true)) by_name.emplace(item.key(), item.value());
  std::vector<UnitSummary> rows;
  for (const auto& u : sm_->units()) {
    UnitSummary r;
    r.name = u.name;
    r.parameters = u.numel;
    for (const auto& n : u.param_names) {
      auto it = by_name.find(n);
      if (it != by_name.end() && it->second.requires_grad()) r.trainable += it->second.numel();
    }
    r.shard_elements = u.shard_numel;
    r.shard_bytes = u.shard_numel * static_cast<int64_t>(sizeof(float));  // float32 master shards
    rows.push_back(std::move(r));
  }
  return rows;
}

sharding::ShardedStateDict ShardedStrategyBase::ShardedState() const {
  if (!sm_) NotSharded("ShardedState");
  return sm_->GetShardedStateDict();
}

std::vector<int64_t> ShardedStrategyBase::ShardedOptimizerSteps(const std::vector<at::Tensor>& params,
                                                                const sharding::OptimizerStates& states) const {
  if (!sm_) NotSharded("ShardedOptimizerSteps");
  return sharding::UnitOptimizerSteps(*sm_, params, states);
}

std::map<std::string, at::Tensor> ShardedStrategyBase::ShardedOptimizerUnit(const std::vector<at::Tensor>& params,
                                                                            const sharding::OptimizerStates& states,
                                                                            int unit) const {
  if (!sm_) NotSharded("ShardedOptimizerUnit");
  return sharding::UnitOptimizerState(*sm_, params, states, unit);
}

std::vector<std::string> ShardedStrategyBase::CheckShardedState(
    const std::vector<sharding::ShardedStateDict>& pieces) const {
  if (!sm_) NotSharded("CheckShardedState");
  return sm_->CheckShardedStateDict(pieces);
}

void ShardedStrategyBase::LoadShardedState(const std::vector<sharding::ShardedStateDict>& pieces) {
  if (!sm_) NotSharded("LoadShardedState");
  sm_->LoadShardedStateDict(pieces);
}

sharding::OptimizerStates ShardedStrategyBase::OptimizerStatesFromShards(
    const std::vector<at::Tensor>& params, const std::vector<sharding::ShardedStateDict>& pieces,
    const std::vector<sharding::ShardedOptimizerState>& optimizer) const {
  if (!sm_) NotSharded("OptimizerStatesFromShards");
  return sharding::OptimizerStatesFromShards(*sm_, params, pieces, optimizer);
}

void ShardedStrategyBase::LoadShardsWith(const std::function<void(size_t, at::Tensor&)>& fill,
                                         const std::map<std::string, at::Tensor>& buffers) {
  if (!sm_) NotSharded("LoadShardsWith");
  sm_->LoadShardsWith(fill, buffers);
}

sharding::OptimizerStates ShardedStrategyBase::OptimizerStatesFromUnits(
    const std::vector<at::Tensor>& params, const std::function<sharding::UnitShardState(size_t)>& unit_state) const {
  if (!sm_) NotSharded("OptimizerStatesFromUnits");
  return sharding::OptimizerStatesFromUnits(*sm_, params, unit_state);
}

void CheckTypeList(const std::string& strategy, const std::string& key, const std::vector<std::string>& types) {
  ST_CHECK_ARG(!types.empty(), "strategy '", strategy, "': ", key,
               " needs at least one module type name, e.g. BlockImpl,MlpImpl");
}

std::vector<std::string> SplitTypeNames(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto b = item.find_first_not_of(' ');
    auto e = item.find_last_not_of(' ');
    if (b != std::string::npos) out.push_back(item.substr(b, e - b + 1));
  }
  return out;
}

}  // namespace shardtrain::strategies
