#include "strategies/fsdp/fsdp_strategy.h"

#include "base/errors.h"

namespace shardtrain::strategies {

using option_parsing::ParseBool;
using option_parsing::ParseDouble;
using option_parsing::ParseDtype;
using option_parsing::ParseInt;

std::vector<std::string> FsdpOptions::ValidKeys() {
  return {"reshard_after_forward", "flatten_parameters", "mixed_precision", "compute_dtype", "buffer_dtype",
          "fp32_reduce_scatter", "move_grads_to_cpu", "cpu_offload", "bucket_cap_mb", "min_num_params",
          "state_dict_to_cpu", "gradient_predivide_factor", "gradient_postdivide_factor", "activation_checkpointing"};
}

FsdpOptions FsdpOptions::FromStrings(const StrategyOptions& in, const std::string& n) {
  FsdpOptions o;
  for (const auto& [k, v] : in) {
    if (k == "reshard_after_forward") o.reshard_after_forward = ParseBool(n, k, v);
    else if (k == "flatten_parameters") o.flatten_parameters = ParseBool(n, k, v);
    else if (k == "mixed_precision") o.mixed_precision = ParseBool(n, k, v);
    else if (k == "compute_dtype") o.compute_dtype = ParseDtype(n, k, v);
    else if (k == "buffer_dtype") o.buffer_dtype = ParseDtype(n, k, v);
    else if (k == "fp32_reduce_scatter") o.fp32_reduce_scatter = ParseBool(n, k, v);
    else if (k == "move_grads_to_cpu") o.move_grads_to_cpu = ParseBool(n, k, v);
    else if (k == "cpu_offload") o.cpu_offload = ParseBool(n, k, v);
    else if (k == "bucket_cap_mb") o.bucket_cap_mb = ParseDouble(n, k, v);
    else if (k == "min_num_params") o.min_num_params = ParseInt(n, k, v);
    else if (k == "state_dict_to_cpu") o.state_dict_to_cpu = ParseBool(n, k, v);
    else if (k == "gradient_predivide_factor") o.gradient_predivide_factor = ParseDouble(n, k, v);
    else if (k == "gradient_postdivide_factor") o.gradient_postdivide_factor = ParseDouble(n, k, v);
    else if (k == "activation_checkpointing") {
      o.activation_checkpointing = SplitTypeNames(v);
      ST_CHECK_ARG(!o.activation_checkpointing.empty(), "strategy '", n,
                   "': activation_checkpointing needs at least one module type name, e.g. BlockImpl,MlpImpl");
    }
    else {
      std::string valid;
      for (const auto& key : ValidKeys()) valid += (valid.empty() ? "" : ", ") + key;
      ST_THROW(InvalidArgumentError, "strategy '", n, "': unknown option ", k, "; valid options: ", valid);
    }
  }
  return o;
}

FsdpStrategy::FsdpStrategy(FsdpOptions options, std::string name) : options_(options), name_(std::move(name)) {
  const auto& o = options_;
  ST_CHECK_ARG(o.flatten_parameters, "strategy '", name_,
               "': flatten_parameters=false is not supported: ShardTrain always shards a unit's parameters "
               "as one flat buffer (set flatten_parameters=true or leave it out)");
  ST_CHECK_ARG(!o.fp32_reduce_scatter || o.mixed_precision, "strategy '", name_,
               "': fp32_reduce_scatter=true requires mixed_precision=true (as in fairscale)");
  ST_CHECK_ARG(!o.cpu_offload || o.mixed_precision, "strategy '", name_,
               "': cpu_offload=true requires mixed_precision=true (as in fairscale)");
  ST_CHECK_ARG(!o.compute_dtype || o.mixed_precision || *o.compute_dtype == c10::ScalarType::Float, "strategy '",
               name_, "': compute_dtype=", option_parsing::DtypeName(*o.compute_dtype),
               " requires mixed_precision=true (without it everything is fp32)");
  ST_CHECK_ARG(o.bucket_cap_mb >= 0, "strategy '", name_, "': bucket_cap_mb must be >= 0, got ", o.bucket_cap_mb);
  ST_CHECK_ARG(o.min_num_params >= 0, "strategy '", name_, "': min_num_params must be >= 0, got ",
               o.min_num_params);
  ST_CHECK_ARG(o.gradient_predivide_factor >= 0 && o.gradient_postdivide_factor >= 0, "strategy '", name_,
               "': gradient pre/post divide factors must be > 0 (or 0 for the default)");
  for (const auto& t : {o.compute_dtype, o.buffer_dtype}) {
    ST_CHECK_ARG(!t || *t == c10::ScalarType::Float || *t == c10::ScalarType::BFloat16 ||
                     *t == c10::ScalarType::Half,
                 "strategy '", name_, "': dtypes must be fp16, bf16 or fp32");
  }
  policy_ = o.min_num_params > 0 ? sharding::WrapPolicy::SizeBased(o.min_num_params) : sharding::WrapPolicy::Always();
  state_dict_to_cpu_ = o.state_dict_to_cpu;
  if (o.cpu_offload) {
    offload_requested_by_ = "cpu_offload=true";
  } else if (o.move_grads_to_cpu) {
    offload_requested_by_ = "move_grads_to_cpu=true";
  }
  if (!o.activation_checkpointing.empty()) {
    checkpoint_ = [by_type = sharding::WrapPolicy::ByType(o.activation_checkpointing)](const sharding::WrapPoint& wp) {
      return by_type.should_wrap(wp, 0);
    };
  }
  auto& s = sharding_options_;
  s.sharding_strategy =
      o.reshard_after_forward ? sharding::ShardingStrategy::kFullShard : sharding::ShardingStrategy::kShardGradOp;
  s.fp32_reduce_scatter = o.fp32_reduce_scatter;
  s.gradient_predivide_factor = o.gradient_predivide_factor;
  s.gradient_postdivide_factor = o.gradient_postdivide_factor;
  s.sync_module_states = true;
  if (o.mixed_precision) {
    auto compute = o.compute_dtype.value_or(c10::ScalarType::Half);
    s.mixed_precision.param_dtype = compute;
    s.mixed_precision.reduce_dtype = o.fp32_reduce_scatter ? c10::ScalarType::Float : compute;
    s.mixed_precision.buffer_dtype = o.buffer_dtype.value_or(compute);
  } else if (o.buffer_dtype) {
    s.mixed_precision.buffer_dtype = o.buffer_dtype;
  }
}

void FsdpStrategy::PrepareOptions(sharding::ShardingOptions& s) const {
  if (!options_.mixed_precision && precision_ != "32-true") {
    // The trainer's precision picks the compute dtype (Lightning's FSDP precision plugin).
    auto mp = PrecisionToMixed(precision_);
    if (options_.buffer_dtype) mp.buffer_dtype = options_.buffer_dtype;
    s.mixed_precision = mp;
  }
}

namespace {
StrategyPtr MakeFsdp(const StrategyOptions& o, const std::string& name) {
  return std::make_shared<FsdpStrategy>(FsdpOptions::FromStrings(o, name), name);
}
const bool kRegistered = RegisterStrategy(
    "fsdp", FsdpOptions::ValidKeys(), [](const StrategyOptions& o) { return MakeFsdp(o, "fsdp"); },
    "Fully Sharded Data Parallel with fairscale FSDP options");
const bool kRegisteredAlias = RegisterStrategy(
    "ddp_fully_sharded", FsdpOptions::ValidKeys(),
    [](const StrategyOptions& o) { return MakeFsdp(o, "ddp_fully_sharded"); }, "alias of fsdp");
}  // namespace

}  // namespace shardtrain::strategies
