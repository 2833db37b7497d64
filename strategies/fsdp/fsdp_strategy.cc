#include "strategies/fsdp/fsdp_strategy.h"

#include "base/errors.h"

namespace shardtrain::strategies {

namespace {
using O = FsdpOptions;
using Core = sharding::ShardingOptions;
}  // namespace

const OptionTable<FsdpOptions>& FsdpOptions::Table() {
  static const OptionTable<O> table({
      {{"reshard_after_forward", "true|false",
        "true (default): FULL_SHARD, free full parameters after forward; false: SHARD_GRAD_OP"},
       [](O& o, const std::string& n, const std::string& k, const std::string& v) {
         o.sharding.sharding_strategy = option_parsing::ParseBool(n, k, v) ? sharding::ShardingStrategy::kFullShard
                                                                            : sharding::ShardingStrategy::kShardGradOp;
       }},
      OptionBool("flatten_parameters", &O::flatten_parameters,
                 "must be true (the core always flattens a unit's parameters; false is rejected)"),
      OptionBool("mixed_precision", &O::mixed_precision,
                 "fp32 master shards, compute and reduce in compute_dtype (default false)"),
      OptionDtype("compute_dtype", &O::compute_dtype, "compute dtype with mixed_precision (default fp16, as fairscale)"),
      OptionDtype("buffer_dtype", &O::buffer_dtype, "dtype of buffers (default: compute_dtype)"),
      OptionBool("fp32_reduce_scatter", Field<O, bool>(&O::sharding, &Core::fp32_reduce_scatter),
                 "reduce gradients in fp32 (needs mixed_precision, as in fairscale)"),
      OptionBool("move_grads_to_cpu", &O::move_grads_to_cpu,
                 "reduced gradient shards in host memory: turns on the same offload as cpu_offload"),
      OptionBool("cpu_offload", &O::cpu_offload,
                 "with a CUDA accelerator, shards, gradients and the optimizer step in pinned host memory "
                 "(needs mixed_precision); on CPU it stays off"),
      OptionDouble("bucket_cap_mb", &O::bucket_cap_mb,
                   "0 only (the default; fairscale's 0, no bucketing): each unit's gradient is reduce-scattered "
                   "as one collective; min_num_params merges small units"),
      OptionInt("min_num_params", &O::min_num_params,
                "0 (default): every Sharded<> wrap point is a unit; N > 0: smaller wrap points join their parent"),
      OptionShardedConstruction(&O::sharded_construction),
      OptionBool("state_dict_to_cpu", &O::state_dict_to_cpu,
                 "true only (the default): full state dicts and checkpoints are gathered into host memory unit by "
                 "unit, so the whole model never sits on the device"),
      OptionDouble("gradient_predivide_factor", Field<O, double>(&O::sharding, &Core::gradient_predivide_factor),
                   "divide gradients by this before the reduction (> 0; default: PyTorch's split of the world size)"),
      OptionDouble("gradient_postdivide_factor", Field<O, double>(&O::sharding, &Core::gradient_postdivide_factor),
                   "divide gradients by this after the reduction (> 0; default: the rest of the world size)"),
      OptionTypeList("activation_checkpointing", &O::activation_checkpointing,
                     "units of these module types (full name or its part after \"::\") recompute forward in "
                     "backward"),
  });
  return table;
}

FsdpOptions FsdpOptions::FromStrings(const StrategyOptions& in, const std::string& n) { return Table().Parse(in, n); }

FsdpStrategy::FsdpStrategy(FsdpOptions options, std::string name) : options_(options), name_(std::move(name)) {
  const auto& o = options_;
  ST_CHECK_ARG(!o.sharding.offload_params, "strategy '", name_,
               "': set cpu_offload=true, not sharding.offload_params (WrapModel turns that on for a CUDA model)");
  const auto& mp = o.sharding.mixed_precision;
  ST_CHECK_ARG(!mp.param_dtype && !mp.reduce_dtype && !mp.buffer_dtype, "strategy '", name_,
               "': set mixed_precision, compute_dtype and buffer_dtype, not sharding.mixed_precision (fairscale's "
               "options decide it)");
  ST_CHECK_ARG(o.flatten_parameters, "strategy '", name_,
               "': flatten_parameters=false is not supported: ShardTrain always shards a unit's parameters "
               "as one flat buffer (set flatten_parameters=true or leave it out)");
  ST_CHECK_ARG(!o.sharding.fp32_reduce_scatter || o.mixed_precision, "strategy '", name_,
               "': fp32_reduce_scatter=true requires mixed_precision=true (as in fairscale)");
  ST_CHECK_ARG(!o.cpu_offload || o.mixed_precision, "strategy '", name_,
               "': cpu_offload=true requires mixed_precision=true (as in fairscale)");
  ST_CHECK_ARG(!o.compute_dtype || o.mixed_precision || *o.compute_dtype == c10::ScalarType::Float, "strategy '",
               name_, "': compute_dtype=", option_parsing::DtypeName(*o.compute_dtype),
               " requires mixed_precision=true (without it everything is fp32)");
  ST_CHECK_ARG(o.bucket_cap_mb == 0, "strategy '", name_, "': bucket_cap_mb=", o.bucket_cap_mb,
               " is not supported: ShardTrain reduce-scatters each unit's gradient as one collective, as fairscale "
               "with bucket_cap_mb=0 (no bucketing across units); leave it out or set 0, and raise min_num_params "
               "to make fewer, larger units");
  ST_CHECK_ARG(o.min_num_params >= 0, "strategy '", name_, "': min_num_params must be >= 0, got ",
               o.min_num_params);
  ST_CHECK_ARG(o.sharding.gradient_predivide_factor >= 0 && o.sharding.gradient_postdivide_factor >= 0,
               "strategy '", name_,
               "': gradient pre/post divide factors must be > 0 (or 0 for the default)");
  sharding::CheckMixedPrecisionDtype("strategy '" + name_ + "': compute_dtype", o.compute_dtype);
  sharding::CheckMixedPrecisionDtype("strategy '" + name_ + "': buffer_dtype", o.buffer_dtype);
  sharded_construction_ = o.sharded_construction;
  policy_ = o.min_num_params > 0 ? sharding::WrapPolicy::SizeBased(o.min_num_params) : sharding::WrapPolicy::Always();
  if (o.auto_wrap_policy_fn.should_wrap) {
    ST_CHECK_ARG(o.min_num_params == 0, "strategy '", name_,
                 "': give auto_wrap_policy_fn (a C++ policy) or min_num_params=", o.min_num_params, ", not both");
    policy_ = o.auto_wrap_policy_fn;
  }
  ST_CHECK_ARG(o.state_dict_to_cpu, "strategy '", name_,
               "': state_dict_to_cpu=false is not supported: full state dicts and the Trainer's checkpoints are "
               "gathered into host memory one unit at a time, so the whole model is never held on the device "
               "(leave it out or set true)");
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
  s = o.sharding;
  s.sync_module_states = true;  // fairscale has no such option: ranks always start from rank 0's weights
  if (o.mixed_precision) {
    auto compute = o.compute_dtype.value_or(c10::ScalarType::Half);
    s.mixed_precision.param_dtype = compute;
    s.mixed_precision.reduce_dtype = o.sharding.fp32_reduce_scatter ? c10::ScalarType::Float : compute;
    s.mixed_precision.buffer_dtype = o.buffer_dtype.value_or(compute);
  } else if (o.buffer_dtype) {
    s.mixed_precision.buffer_dtype = o.buffer_dtype;
  }
}

void FsdpStrategy::PrepareOptions(sharding::ShardingOptions& s) const {
  if (!options_.mixed_precision && precision_ != Precision::k32True) {
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
    "fsdp", FsdpOptions::Table().Docs(), [](const StrategyOptions& o) { return MakeFsdp(o, "fsdp"); },
    "Fully Sharded Data Parallel with fairscale FSDP options");
const bool kRegisteredAlias = RegisterStrategyVariant(
    "ddp_fully_sharded", "fsdp", [](const StrategyOptions& o) { return MakeFsdp(o, "ddp_fully_sharded"); },
    "alias of fsdp");
}  // namespace

}  // namespace shardtrain::strategies
