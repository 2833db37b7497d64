#include "strategies/fsdp_native/fsdp_native_strategy.h"

#include <cctype>

#include "base/errors.h"

namespace shardtrain::strategies {
namespace {

using option_parsing::ParseBool;
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

void CheckDtype(const std::string& name, const char* field, const std::optional<c10::ScalarType>& t) {
  if (!t) return;
  ST_CHECK_ARG(*t == c10::ScalarType::Float || *t == c10::ScalarType::BFloat16 || *t == c10::ScalarType::Half,
               "strategy '", name, "': mixed_precision.", field, " must be bf16, fp16 or fp32, got ",
               c10::toString(*t));
}

}  // namespace

std::vector<std::string> FsdpNativeOptions::ValidKeys() {
  return {"sharding_strategy", "hybrid_shard_group_size", "cpu_offload", "offload_params", "auto_wrap_policy",
          "backward_prefetch", "forward_prefetch", "limit_all_gathers", "mixed_precision", "param_dtype",
          "reduce_dtype", "buffer_dtype", "sync_module_states", "use_orig_params",
          "activation_checkpointing_policy", "activation_checkpointing", "state_dict_type"};
}

FsdpNativeOptions FsdpNativeOptions::FromStrings(const StrategyOptions& in, const std::string& n) {
  FsdpNativeOptions o;
  for (const auto& [k, v] : in) {
    if (k == "sharding_strategy") {
      o.sharding_strategy = sharding::ParseShardingStrategy(v);
    } else if (k == "hybrid_shard_group_size") {
      o.hybrid_shard_group_size = static_cast<int>(ParseInt(n, k, v));
    } else if (k == "cpu_offload" || k == "offload_params") {
      o.cpu_offload = ParseBool(n, k, v);
    } else if (k == "auto_wrap_policy") {
      o.auto_wrap_policy = v;
    } else if (k == "backward_prefetch") {
      o.backward_prefetch = sharding::ParseBackwardPrefetch(v);
    } else if (k == "forward_prefetch") {
      o.forward_prefetch = ParseBool(n, k, v);
    } else if (k == "limit_all_gathers") {
      o.limit_all_gathers = ParseBool(n, k, v);
    } else if (k == "mixed_precision") {
      auto t = ParseDtype(n, k, v);
      o.mixed_precision.param_dtype = o.mixed_precision.param_dtype.value_or(t);
      o.mixed_precision.reduce_dtype = o.mixed_precision.reduce_dtype.value_or(t);
      o.mixed_precision.buffer_dtype = o.mixed_precision.buffer_dtype.value_or(t);
    } else if (k == "param_dtype") {
      o.mixed_precision.param_dtype = ParseDtype(n, k, v);
    } else if (k == "reduce_dtype") {
      o.mixed_precision.reduce_dtype = ParseDtype(n, k, v);
    } else if (k == "buffer_dtype") {
      o.mixed_precision.buffer_dtype = ParseDtype(n, k, v);
    } else if (k == "sync_module_states") {
      o.sync_module_states = ParseBool(n, k, v);
    } else if (k == "use_orig_params") {
      o.use_orig_params = ParseBool(n, k, v);
    } else if (k == "activation_checkpointing_policy") {
      o.activation_checkpointing_policy = v;
    } else if (k == "activation_checkpointing") {
      o.activation_checkpointing = SplitTypeNames(v);
      ST_CHECK_ARG(!o.activation_checkpointing.empty(), "strategy '", n,
                   "': activation_checkpointing needs at least one module type name, e.g. BlockImpl,MlpImpl");
    } else if (k == "state_dict_type") {
      o.state_dict_type = v;
    } else {
      std::string valid;
      for (const auto& key : ValidKeys()) valid += (valid.empty() ? "" : ", ") + key;
      ST_THROW(InvalidArgumentError, "strategy '", n, "': unknown option ", k, "; valid options: ", valid);
    }
  }
  return o;
}

FsdpNativeStrategy::FsdpNativeStrategy(FsdpNativeOptions options, std::string name)
    : options_(std::move(options)), name_(std::move(name)) {
  const auto& o = options_;
  for (auto& c : options_.state_dict_type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  ST_CHECK_ARG(o.state_dict_type == "full" || o.state_dict_type == "sharded", "strategy '", name_,
               "': unsupported state_dict_type '", o.state_dict_type,
               "'; valid: full, sharded (LOCAL state dicts are not supported)");
  ST_CHECK_ARG(o.hybrid_shard_group_size >= 0, "strategy '", name_, "': hybrid_shard_group_size must be >= 0, got ",
               o.hybrid_shard_group_size);
  ST_CHECK_ARG(o.hybrid_shard_group_size == 0 || o.sharding_strategy == sharding::ShardingStrategy::kHybridShard,
               "strategy '", name_, "': hybrid_shard_group_size is only valid with sharding_strategy=HYBRID_SHARD, not ",
               sharding::ShardingStrategyName(o.sharding_strategy));
  CheckDtype(name_, "param_dtype", o.mixed_precision.param_dtype);
  CheckDtype(name_, "reduce_dtype", o.mixed_precision.reduce_dtype);
  CheckDtype(name_, "buffer_dtype", o.mixed_precision.buffer_dtype);
  policy_ = ParseAutoWrapPolicy(name_, o.auto_wrap_policy);
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
  auto& s = sharding_options_;
  s.sharding_strategy = o.sharding_strategy;
  s.hybrid_shard_group_size = o.hybrid_shard_group_size;
  s.backward_prefetch = o.backward_prefetch;
  s.forward_prefetch = o.forward_prefetch;
  s.limit_all_gathers = o.limit_all_gathers ? 2 : 0;
  s.mixed_precision = o.mixed_precision;
  s.sync_module_states = o.sync_module_states;
  s.use_orig_params = o.use_orig_params;
  if (o.cpu_offload) {
    offload_requested_by_ =
        name_ == "fsdp_native_full_shard_offload" ? "the strategy name" : "cpu_offload(offload_params=true)";
  }
}

void FsdpNativeStrategy::Setup(comm::CommunicatorPtr world, const ClusterInfo& cluster) {
  Strategy::Setup(std::move(world), cluster);
  const int W = world_size();
  if (options_.sharding_strategy == sharding::ShardingStrategy::kHybridShard) {
    int g = options_.hybrid_shard_group_size > 0 ? options_.hybrid_shard_group_size
                                                  : (cluster_.local_world_size > 0 ? cluster_.local_world_size : W);
    ST_CHECK_ARG(g > 0 && W % g == 0, "strategy '", name_, "': HYBRID_SHARD shard group size ", g,
                 " does not divide the world size ", W, "; set hybrid_shard_group_size to a divisor of ", W);
  }
}

void FsdpNativeStrategy::PrepareOptions(sharding::ShardingOptions& s) const {
  const auto& mp = options_.mixed_precision;
  if (!mp.param_dtype && !mp.reduce_dtype && !mp.buffer_dtype) s.mixed_precision = PrecisionToMixed(precision_);
}

namespace {
const bool kRegistered = RegisterStrategy(
    "fsdp_native", FsdpNativeOptions::ValidKeys(),
    [](const StrategyOptions& o) {
      return std::make_shared<FsdpNativeStrategy>(FsdpNativeOptions::FromStrings(o, "fsdp_native"), "fsdp_native");
    },
    "Fully Sharded Data Parallel with PyTorch FSDP options");
const bool kRegisteredOffload = RegisterStrategy(
    "fsdp_native_full_shard_offload", FsdpNativeOptions::ValidKeys(),
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
