#include "sharding/sharded_init.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <string>
#include <unordered_set>
#include <vector>

#include "base/errors.h"
#include "base/names.h"
#include "sharding/host_memory.h"

namespace shardtrain::sharding {
namespace {
thread_local ShardedInitScope* g_active_init_scope = nullptr;

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * std::max<int64_t>(shape[i + 1], 1);
  }
  return strides;
}

// Points each entry's parameter at its place (e.offset) in a buffer of
// `padded` float32 values with `options` that holds no bytes, as ShardedModel
// leaves a resharded unit: a read or write of them before a ShardedModel
// adopts the shard throws a message naming them (LibTorch checks the flag in
// every data-pointer access) instead of touching freed memory.
void MakeValueless(const std::vector<FlatParamEntry>& entries, const at::TensorOptions& options, int64_t padded,
                   const std::string& wrap_type) {
  // Views are made while the buffer's size is set (bounds checks), then it is marked freed.
  at::Tensor base = at::empty({0}, options);
  base.storage().unsafeGetStorageImpl()->set_nbytes(static_cast<size_t>(padded) * sizeof(float));
  for (const auto& e : entries) {
    at::Tensor view = at::empty({0}, options);
    view.set_(base.storage(), e.offset, e.shape, ContiguousStrides(e.shape));
    e.param.set_data(view);  // the values held so far are released here (unless held elsewhere)
  }
  FreeStorage(base);
  std::vector<std::string> entry_names;
  for (const auto& e : entries) entry_names.push_back(e.name);
  const std::string names = JoinNames(entry_names, 6, "'");
  base.storage().unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
      std::string(entries.size() > 1 ? "parameters " : "parameter ") + names + " of a Sharded<" + wrap_type +
      "> wrap point hold" + (entries.size() > 1 ? "" : "s") +
      " no values: sharded construction (the strategy option sharded_construction, "
      "TrainerOptions::sharded_construction, sharding::ShardedInitScope) kept only this rank's shard when the "
      "wrap point was built, until the strategy wraps the model. Initialise parameters inside the wrapped "
      "module's constructor (or load weights after the Trainer's setup), or set sharded_construction=false");
}
}  // namespace

ShardGroupPlace ShardGroupOf(int world_rank, int world_size, const ShardingOptions& options, int local_world_size) {
  ST_CHECK_ARG(world_size >= 1 && world_rank >= 0 && world_rank < world_size, "ShardGroupOf: rank ", world_rank,
               " is not in a world of ", world_size);
  switch (options.sharding_strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      return {world_rank, world_size};
    case ShardingStrategy::kNoShard:
      return {0, 1};
    case ShardingStrategy::kHybridShard: {
      const int s = HybridShardGroupSize(options, world_size, local_world_size);
      return {world_rank % s, s};
    }
  }
  return {world_rank, world_size};
}

ShardedInitScope::ShardedInitScope(ShardGroupPlace place, WrapPolicy policy)
    : place_(place), policy_(std::move(policy)), previous_(g_active_init_scope) {
  ST_CHECK_ARG(place_.size >= 1 && place_.rank >= 0 && place_.rank < place_.size, "ShardedInitScope: shard rank ",
               place_.rank, " is not in a shard group of ", place_.size, " (valid: 0..size-1, size >= 1)");
  ST_CHECK_ARG(policy_.should_wrap != nullptr, "ShardedInitScope: the wrap policy has no should_wrap function");
  KeepFreedHostMemoryReturnable();  // construction frees a unit's full values per wrap point
  InstallHostBlockCache();
  g_active_init_scope = this;
}

ShardedInitScope::ShardedInitScope(const comm::Communicator& world, const ShardingOptions& options, WrapPolicy policy,
                                   int local_world_size)
    : ShardedInitScope(ShardGroupOf(world.rank(), world.size(), options, local_world_size), std::move(policy)) {}

ShardedInitScope::~ShardedInitScope() {
  g_active_init_scope = previous_;
  ReleaseHostBlockCache();  // construction's transients are not the step's
}

ShardedInitScope* ShardedInitScope::Active() { return g_active_init_scope; }

void ShardedInitScope::Take(WrapPoint& point, torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  // The subtree's parameters that no nested wrap point took, once each, in
  // registration order; trainable first, as ShardedModel lays out a unit.
  std::vector<FlatParamEntry> entries;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
    if (taken_.count(impl) || !seen.insert(impl).second || StorageIsFreed(p)) continue;
    ST_CHECK_ARG(p.scalar_type() == at::kFloat, "ShardedInitScope: parameter '", item.key(), "' of wrap point ",
                 point.WrapTypeName(), " is ", p.scalar_type(),
                 "; sharded parameters must be float32 (lower precision is set with mixed_precision.param_dtype)");
    FlatParamEntry e;
    e.name = item.key();
    e.param = p;
    e.requires_grad = p.requires_grad();
    e.shape = p.sizes().vec();
    e.numel = p.numel();
    entries.push_back(std::move(e));
  }
  std::stable_partition(entries.begin(), entries.end(), [](const FlatParamEntry& e) { return e.requires_grad; });
  int64_t numel = 0;
  for (const auto& e : entries) numel += e.numel;
  if (entries.empty() || !policy_.should_wrap(point, numel)) return;  // the parent (or the root) takes them

  const c10::Device device = entries.front().param.device();
  const int64_t padded = (numel + place_.size - 1) / place_.size * place_.size;
  const int64_t shard_numel = padded / place_.size;
  const int64_t lo = place_.rank * shard_numel, hi = lo + shard_numel;
  auto pre = std::make_shared<internal::PrebuiltUnit>();
  pre->shard = at::zeros({shard_numel}, at::TensorOptions().dtype(at::kFloat).device(device));  // padding stays 0
  pre->place = place_;
  pre->numel = numel;
  pre->padded_numel = padded;
  int64_t offset = 0;
  for (auto& e : entries) {
    ST_CHECK_ARG(e.param.device() == device, "ShardedInitScope: wrap point ", point.WrapTypeName(),
                 " has parameters on different devices: '", entries.front().name, "' on ", device, " and '", e.name,
                 "' on ", e.param.device(), "; construct the model on one device");
    at::Tensor flat = e.param.detach().reshape({-1});
    pre->checksum += flat.sum().item<double>();
    const int64_t b = std::max(lo, offset), end = std::min(hi, offset + e.numel);
    if (b < end) pre->shard.narrow(0, b - lo, end - b).copy_(flat.narrow(0, b - offset, end - b));
    e.offset = offset;
    offset += e.numel;
    taken_.insert(e.param.unsafeGetTensorImpl());
  }
  MakeValueless(entries, pre->shard.options(), padded, point.WrapTypeName());
  pre->entries = std::move(entries);
  point.prebuilt_ = std::move(pre);
  ++units_built_;
  shard_bytes_ += shard_numel * static_cast<int64_t>(sizeof(float));
}

void ShardedInitScope::MoveToDevice(torch::nn::Module& module, c10::Device device) {
  at::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> sharded;
  for (const auto& m : module.modules()) {
    auto* wp = dynamic_cast<WrapPoint*>(m.get());
    if (!wp || !wp->prebuilt_) continue;
    internal::PrebuiltUnit& pre = *wp->prebuilt_;
    for (const auto& e : pre.entries) sharded.insert(e.param.unsafeGetTensorImpl());
    if (pre.shard.device() == device) continue;
    pre.shard = pre.shard.to(device);
    MakeValueless(pre.entries, pre.shard.options(), pre.padded_numel, wp->WrapTypeName());
  }
  for (auto& p : module.parameters()) {
    if (!sharded.count(p.unsafeGetTensorImpl())) p.set_data(p.to(device));
  }
  for (auto& b : module.buffers()) b.set_data(b.to(device));
}

namespace internal {
void OnWrapPointConstructed(WrapPoint& point, torch::nn::Module& module) {
  if (g_active_init_scope != nullptr) g_active_init_scope->Take(point, module);
}
}  // namespace internal

}  // namespace shardtrain::sharding
