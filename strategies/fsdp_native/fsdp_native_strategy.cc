#include "strategies/fsdp_native/fsdp_native_strategy.h"

#include <cctype>

#include "base/errors.h"

namespace shardtrain::strategies {
namespace {

using option_parsing::ParseDtype;
using option_parsing::ParseInt;

sharding::WrapPolicy ParseAutoWrapPolicy(const std::string& name, const std::string& v) {
  if (v == "always") return sharding::WrapPolicy::Always();
  if (v == "never") return sharding::WrapPolicy::Never();
  if (v.rfind("size:", 0) == 0) {
    int64_t n = ParseInt(name, "auto_wrap_policy", v.substr(5));
    ST_CHECK_ARG(n > 0, "strategy '", name, "': auto_wrap_policy size:N needs N > 0, got '", v, "'");
    return sharding::WrapPolicy::SizeBased(n);
  }
  if (v.rfind("type:", 0) == 0) {
    auto types = SplitTypeNames(v.substr(5));
    ST_CHECK_ARG(!types.empty(), "strategy '", name, "': auto_wrap_policy type: needs at least one type name");
    return sharding::WrapPolicy::ByType(types);
  }
  ST_THROW(InvalidArgumentError, "strategy '", name, "': unknown auto_wrap_policy '", v,
           "'; valid: always, never, size:N, type:TypeA,TypeB");
}

}  // namespace

namespace {
using O = FsdpNativeOptions;
using SetFn = std::function<void(O&, const std::string&, const std::string&, const std::string&)>;

OptionRow<O> Row(std::string key, std::string values, std::string doc, SetFn set) {
  return {{std::move(key), std::move(values), std::move(doc)}, std::move(set)};
}

// A field of the core's options (FsdpNativeOptions::sharding).
template <typename T>
Field<O, T> Core(T sharding::ShardingOptions::*field) {
  return Field<O, T>(&O::sharding, field);
}

// param_dtype, reduce_dtype, buffer_dtype: one field of the core's MixedPrecision.
OptionRow<O> MixedPrecisionDtype(std::string key, std::optional<c10::ScalarType> sharding::MixedPrecision::*field,
                                 std::string doc) {
  return Row(std::move(key), "bf16|fp16|fp32", std::move(doc),
             [field](O& o, const std::string& n, const std::string& k, const std::string& v) {
               o.sharding.mixed_precision.*field = ParseDtype(n, k, v);
             });
}
}  // namespace

const OptionTable<FsdpNativeOptions>& FsdpNativeOptions::Table() {
  static const OptionTable<O> table({
      Row("sharding_strategy", "FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|HYBRID_SHARD", "how parameters, gradients and "
          "optimizer state are split (default FULL_SHARD; case-insensitive)",
          [](O& o, const std::string&, const std::string&, const std::string& v) {
            o.sharding.sharding_strategy = sharding::ParseShardingStrategy(v);
          }),
      OptionInt("hybrid_shard_group_size", Core(&sharding::ShardingOptions::hybrid_shard_group_size),
                "ranks per shard group for HYBRID_SHARD (default 0: ranks per node); must divide the world size"),
      OptionBool("cpu_offload", &O::cpu_offload,
                 "CPUOffload(offload_params=...): with a CUDA accelerator, shards, gradients and the optimizer step "
                 "in pinned host memory; on CPU it stays off (default false)"),
      OptionBool("offload_params", &O::cpu_offload, "same as cpu_offload"),
      OptionString("auto_wrap_policy", "always|never|size:N|type:TypeA,TypeB", &O::auto_wrap_policy,
                   "which Sharded<> wrap points become units: all (default), none, those with at least N "
                   "parameters, or those of the listed module types (transformer_auto_wrap_policy)"),
      Row("backward_prefetch", "BACKWARD_PRE|BACKWARD_POST|NONE",
          "when backward gathers the next unit (default BACKWARD_PRE)",
          [](O& o, const std::string&, const std::string&, const std::string& v) {
            o.sharding.backward_prefetch = sharding::ParseBackwardPrefetch(v);
          }),
      OptionBool("forward_prefetch", Core(&sharding::ShardingOptions::forward_prefetch),
                 "gather the next unit during forward (default false)"),
      Row("limit_all_gathers", "true|false", "at most 2 units unsharded through prefetching (default true)",
          [](O& o, const std::string& n, const std::string& k, const std::string& v) {
            o.sharding.limit_all_gathers = option_parsing::ParseBool(n, k, v) ? 2 : 0;
          }),
      Row("mixed_precision", "bf16|fp16|fp32", "shorthand: param, reduce and buffer dtype not given otherwise",
          [](O& o, const std::string& n, const std::string& k, const std::string& v) {
            auto t = ParseDtype(n, k, v);
            auto& mp = o.sharding.mixed_precision;
            mp.param_dtype = mp.param_dtype.value_or(t);
            mp.reduce_dtype = mp.reduce_dtype.value_or(t);
            mp.buffer_dtype = mp.buffer_dtype.value_or(t);
          }),
      MixedPrecisionDtype("param_dtype", &sharding::MixedPrecision::param_dtype,
                          "dtype of gathered parameters and compute (MixedPrecision.param_dtype)"),
      MixedPrecisionDtype("reduce_dtype", &sharding::MixedPrecision::reduce_dtype,
                          "dtype of gradient reduction (MixedPrecision.reduce_dtype)"),
      MixedPrecisionDtype("buffer_dtype", &sharding::MixedPrecision::buffer_dtype,
                          "dtype of buffers (MixedPrecision.buffer_dtype)"),
      OptionBool("sync_module_states", Core(&sharding::ShardingOptions::sync_module_states),
                 "broadcast rank 0's parameters and buffers at setup (default true, unlike PyTorch: ranks that "
                 "start different would silently train different replicas)"),
      OptionBool("use_orig_params", Core(&sharding::ShardingOptions::use_orig_params),
                 "the optimizer steps per-parameter views of the shards (default false)"),
      OptionString("activation_checkpointing_policy", "type:TypeA,TypeB", &O::activation_checkpointing_policy,
                   "units of the listed module types recompute forward in backward (default none)"),
      OptionTypeList("activation_checkpointing", &O::activation_checkpointing,
                     "Lightning's spelling of the same: a list of module types (give one of the two)"),
      OptionShardedConstruction(&O::sharded_construction),
      OptionString("state_dict_type", "full|sharded", &O::state_dict_type,
                   "checkpoint format: one full file (default) or one piece per rank (LOCAL is not supported)"),
  });
  return table;
}

FsdpNativeOptions FsdpNativeOptions::FromStrings(const StrategyOptions& in, const std::string& n) {
  return Table().Parse(in, n);
}

FsdpNativeStrategy::FsdpNativeStrategy(FsdpNativeOptions options, std::string name)
    : options_(std::move(options)), name_(std::move(name)) {
  const auto& o = options_;
  for (auto& c : options_.state_dict_type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  ST_CHECK_ARG(o.state_dict_type == "full" || o.state_dict_type == "sharded", "strategy '", name_,
               "': unsupported state_dict_type '", o.state_dict_type,
               "'; valid: full, sharded (LOCAL state dicts are not supported)");
  const auto& core = o.sharding;
  ST_CHECK_ARG(!core.offload_params, "strategy '", name_,
               "': set cpu_offload=true, not sharding.offload_params (WrapModel turns that on for a CUDA model)");
  ST_CHECK_ARG(core.hybrid_shard_group_size >= 0, "strategy '", name_,
               "': hybrid_shard_group_size must be >= 0, got ", core.hybrid_shard_group_size);
  ST_CHECK_ARG(core.hybrid_shard_group_size == 0 || core.sharding_strategy == sharding::ShardingStrategy::kHybridShard,
               "strategy '", name_, "': hybrid_shard_group_size is only valid with sharding_strategy=HYBRID_SHARD, not ",
               sharding::ShardingStrategyName(core.sharding_strategy));
  const std::string mp = "strategy '" + name_ + "': mixed_precision.";
  sharding::CheckMixedPrecisionDtype(mp + "param_dtype", core.mixed_precision.param_dtype);
  sharding::CheckMixedPrecisionDtype(mp + "reduce_dtype", core.mixed_precision.reduce_dtype);
  sharding::CheckMixedPrecisionDtype(mp + "buffer_dtype", core.mixed_precision.buffer_dtype);
  policy_ = ParseAutoWrapPolicy(name_, o.auto_wrap_policy);
  if (o.auto_wrap_policy_fn.should_wrap) {
    ST_CHECK_ARG(o.auto_wrap_policy == "always", "strategy '", name_,
                 "': give auto_wrap_policy_fn (a C++ policy) or auto_wrap_policy=", o.auto_wrap_policy, ", not both");
    policy_ = o.auto_wrap_policy_fn;
  }
  ST_CHECK_ARG(o.activation_checkpointing_policy.empty() || o.activation_checkpointing.empty(), "strategy '", name_,
               "': give activation_checkpointing (a list of module types) or activation_checkpointing_policy "
               "(type:A,B), not both");
  std::vector<std::string> checkpoint_types = o.activation_checkpointing;
  if (!o.activation_checkpointing_policy.empty()) {
    const std::string& v = o.activation_checkpointing_policy;
    ST_CHECK_ARG(v.rfind("type:", 0) == 0, "strategy '", name_, "': unknown activation_checkpointing_policy '", v,
                 "'; valid: type:TypeA,TypeB");
    checkpoint_types = SplitTypeNames(v.substr(5));
    ST_CHECK_ARG(!checkpoint_types.empty(), "strategy '", name_,
                 "': activation_checkpointing_policy type: needs a type name");
  }
  if (!checkpoint_types.empty()) {
    // The same type matching as auto_wrap_policy=type: (namespaced names match by their tail).
    checkpoint_ = [by_type = sharding::WrapPolicy::ByType(checkpoint_types)](const sharding::WrapPoint& wp) {
      return by_type.should_wrap(wp, 0);
    };
  }
  sharding_options_ = core;
  sharded_construction_ = o.sharded_construction;
  if (o.cpu_offload) {
    offload_requested_by_ =
        name_ == "fsdp_native_full_shard_offload" ? "the strategy name" : "cpu_offload(offload_params=true)";
  }
}

void FsdpNativeStrategy::Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) {
  Strategy::Setup(std::move(world), cluster);
  const int W = world_size();
  const auto& core = options_.sharding;
  if (core.sharding_strategy == sharding::ShardingStrategy::kHybridShard) {
    sharding::HybridShardGroupSize(core, W, cluster_.local_world_size);  // throws saying what to set
  }
}

void FsdpNativeStrategy::PrepareOptions(sharding::ShardingOptions& s) const {
  const auto& mp = options_.sharding.mixed_precision;
  if (!mp.param_dtype && !mp.reduce_dtype && !mp.buffer_dtype) s.mixed_precision = PrecisionToMixed(precision_);
}

namespace {
const bool kRegistered = RegisterStrategy(
    "fsdp_native", FsdpNativeOptions::Table().Docs(),
    [](const StrategyOptions& o) {
      return std::make_shared<FsdpNativeStrategy>(FsdpNativeOptions::FromStrings(o, "fsdp_native"), "fsdp_native");
    },
    "Fully Sharded Data Parallel with PyTorch FSDP options");
const bool kRegisteredOffload = RegisterStrategyVariant(
    "fsdp_native_full_shard_offload", "fsdp_native",
    [](const StrategyOptions& o) {
      StrategyOptions with = o;
      with.emplace("cpu_offload", "true");
      with.emplace("sharding_strategy", "FULL_SHARD");
      return std::make_shared<FsdpNativeStrategy>(FsdpNativeOptions::FromStrings(with, "fsdp_native_full_shard_offload"),
                                                  "fsdp_native_full_shard_offload");
    },
    "fsdp_native with FULL_SHARD and cpu_offload(offload_params=True)");
}  // namespace

}  // namespace shardtrain::strategies
