// ShardedModel: construction (shard and replicate groups, gradient divide
// factors, sync_module_states), accessors, gradient clipping and the
// no_sync / SummonFullParams scopes. The rest of the implementation is split
// by what it does (sharding/internal/sharded_unit.h lists the files).
#include "sharding/sharded_model.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <tuple>
#include <unordered_set>

#include "base/errors.h"
#include "base/logging.h"
#include "sharding/flat_parameter.h"
#include "sharding/host_memory.h"
#include "sharding/grad_clip.h"
#include "sharding/internal/device_streams.h"
#include "sharding/internal/sharded_unit.h"
#include "sharding/sharded_init.h"

namespace shardtrain::sharding {

namespace internal {
at::Tensor AliasRange(const at::Tensor& base, int64_t offset, int64_t len, bool requires_grad) {
  at::Tensor v = at::empty({0}, base.options().requires_grad(false));
  v.set_(base.storage(), base.storage_offset() + offset, {len}, {1});
  if (requires_grad) v.set_requires_grad(true);
  return v;
}
}  // namespace internal

namespace {
std::mutex g_sharded_modules_mu;
std::unordered_set<const torch::nn::Module*> g_sharded_modules;
}  // namespace

using internal::IsFloating;

// ---------------------------------------------------------------------------
// ShardedModel

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> module, comm::CommunicatorPtr world,
                           ShardingOptions options, WrapPolicy policy, std::function<bool(const WrapPoint&)> checkpoint,
                           int local_world_size)
    : module_(std::move(module)),
      world_(std::move(world)),
      options_(options),
      gather_order_(std::make_unique<internal::GatherOrder>()),
      grad_offload_(std::make_unique<internal::GradOffload>()) {
  ST_CHECK_ARG(module_ != nullptr, "ShardedModel needs a module");
  ST_CHECK_ARG(world_ != nullptr, "ShardedModel needs a communicator");
  ValidateShardingOptions(options_);
  KeepFreedHostMemoryReturnable();  // before any unit is built (sharding/host_memory.h)
  InstallHostBlockCache();
  {
    std::lock_guard<std::mutex> lock(g_sharded_modules_mu);
    for (const auto& m : module_->modules()) {
      ST_CHECK_ARG(!g_sharded_modules.count(m.get()), "module '", m->name(),
                   "' is already part of a ShardedModel; wrap a model only once");
    }
    for (const auto& m : module_->modules()) g_sharded_modules.insert(m.get());
  }
  // Should the constructor throw below, the destructor does not run: unregister here.
  struct Unregister {
    torch::nn::Module* root;
    bool armed = true;
    ~Unregister() {
      if (!armed) return;
      std::lock_guard<std::mutex> lock(g_sharded_modules_mu);
      for (const auto& m : root->modules()) g_sharded_modules.erase(m.get());
    }
  } unregister{module_.get()};
  param_dtype_ = ParamDtype(options_);
  reduce_dtype_ = ReduceDtype(options_);
  const int W = world_->size();
  switch (options_.sharding_strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      shard_group_ = world_;
      break;
    case ShardingStrategy::kNoShard: {
      for (int r = 0; r < W; ++r) {
        auto g = world_->NewGroup({r}, "self" + std::to_string(r));
        if (g) shard_group_ = g;
      }
      if (W > 1) replicate_group_ = world_;
      break;
    }
    case ShardingStrategy::kHybridShard: {
      const int s = HybridShardGroupSize(options_, W, local_world_size);
      auto groups = world_->SplitHybrid(s);
      shard_group_ = groups.shard;
      if (W / s > 1) replicate_group_ = groups.replicate;
      break;
    }
  }
  // Gradient averaging over the whole world, split before/after the sum like PyTorch.
  std::tie(pre_divide_, post_divide_) = GradientDivideFactors(options_, W);

  if (options_.sync_module_states) SyncModuleStates();
  if (const auto buffer_dtype = options_.mixed_precision.buffer_dtype) {
    for (auto& b : module_->buffers()) {
      if (IsFloating(b)) b.set_data(b.to(*buffer_dtype));
    }
  }
  BuildUnits(policy, checkpoint);
  unregister.armed = false;
  ReleaseHostBlockCache();  // the unsharded parameters' blocks are not the step's
}

ShardedModel::~ShardedModel() {
  alive_.reset();
  std::lock_guard<std::mutex> lock(g_sharded_modules_mu);
  for (const auto& m : module_->modules()) g_sharded_modules.erase(m.get());
  for (const auto& m : module_->modules()) {
    if (auto* wp = dynamic_cast<WrapPoint*>(m.get())) wp->unit_ = nullptr;
  }
}

void ShardedModel::SyncModuleStates() {
  if (world_->size() == 1) return;
  at::NoGradGuard no_grad;
  std::vector<comm::WorkPtr> works;
  // Parameters sharded at construction (ShardedInitScope) hold no values to
  // broadcast: every rank computed them from the same seed, which is checked.
  std::vector<double> checksums;
  std::vector<std::string> prebuilt_paths;
  for (const auto& item : module_->named_modules()) {
    auto* wp = dynamic_cast<WrapPoint*>(item.value().get());
    if (wp && wp->prebuilt_) {
      checksums.push_back(wp->prebuilt_->checksum);
      prebuilt_paths.push_back(item.key());
    }
  }
  if (!checksums.empty()) {
    const int64_t n = static_cast<int64_t>(checksums.size());
    at::Tensor mine = at::tensor(checksums, at::kDouble);
    at::Tensor both = at::cat({mine, -mine, at::tensor({static_cast<double>(n), -static_cast<double>(n)}, at::kDouble)});
    world_->AllReduce(both, {comm::ReduceOp::kMax})->Wait();
    ST_CHECK_ARG(both[2 * n].item<double>() == n && -both[2 * n + 1].item<double>() == n,
                 "sync_module_states: ranks sharded different numbers of wrap points at construction "
                 "(ShardedInitScope); construct the model the same way on every rank");
    for (int64_t i = 0; i < n; ++i) {
      ST_CHECK_ARG(both[i].item<double>() == checksums[i] && -both[n + i].item<double>() == checksums[i],
                   "sync_module_states: wrap point '", prebuilt_paths[i],
                   "' was sharded at construction (ShardedInitScope) with different initial values on different "
                   "ranks; seed every rank alike (at::manual_seed) before constructing the model, or construct it "
                   "without the scope so that rank 0's values are broadcast");
    }
  }
  for (auto& p : module_->parameters()) {
    if (!StorageIsFreed(p)) works.push_back(world_->Broadcast(p.detach(), 0));
  }
  for (auto& b : module_->buffers()) {
    if (b.is_contiguous()) works.push_back(world_->Broadcast(b, 0));
  }
  for (auto& w : works) w->Wait();
}
bool ShardedModel::ReshardsAfterForward() const {
  return options_.sharding_strategy == ShardingStrategy::kFullShard ||
         options_.sharding_strategy == ShardingStrategy::kHybridShard;
}

bool ShardedModel::UnitCheckpointing(const ShardedUnit* unit) const { return unit->checkpoint; }

std::vector<at::Tensor> ShardedModel::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ShardedModel::named_parameters() const {
  if (options_.use_orig_params) return orig_param_views_;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& u : units_) {
    out.emplace_back((u->is_root ? std::string("") : u->name + ".") + "flat_param", u->opt_param);
  }
  return out;
}

std::vector<UnitInfo> ShardedModel::units() const {
  std::vector<UnitInfo> out;
  for (auto& u : units_) {
    UnitInfo info;
    info.name = u->name;
    for (auto& e : u->flat->entries()) info.param_names.push_back(e.name);
    info.numel = u->flat->numel();
    info.padded_numel = u->flat->padded_numel();
    info.shard_numel = u->flat->shard_numel();
    out.push_back(std::move(info));
  }
  return out;
}

int ShardedModel::num_units() const { return static_cast<int>(units_.size()); }

int ShardedModel::NumUnshardedUnits() const { return static_cast<int>(UnshardedUnitNames().size()); }

int ShardedModel::NumFullGradients() const {
  int n = 0;
  for (auto& u : units_) {
    // Gradients kept in place (ShardedUnit::grads_in_place) count once the first one arrived.
    const bool in_place = u->grads_in_place && std::find(u->grad_written.begin(), u->grad_written.end(), true) !=
                                                   u->grad_written.end();
    n += u->flat_grad.defined() || u->reduce_in.defined() || !u->reduce_pieces.empty() || in_place;
  }
  return n;
}

std::vector<std::string> ShardedModel::UnshardedUnitNames() const {
  std::vector<std::string> out;
  for (auto& u : units_) {
    if (!u->aliased && u->state != ShardedUnit::State::kSharded) out.push_back(u->is_root ? "<root>" : u->name);
  }
  return out;
}

ShardedModel::NoSyncScope::NoSyncScope(ShardedModel* m) : m_(m), prev_(m->no_sync_) { m_->no_sync_ = true; }
ShardedModel::NoSyncScope::~NoSyncScope() { m_->no_sync_ = prev_; }

// --- utilities ---------------------------------------------------------------

double ShardedModel::ClipGradNorm(double max_norm, double norm_type) {
  return ClipGradNormOnDevice(max_norm, norm_type).item<double>();
}

at::Tensor ShardedModel::ClipGradNormOnDevice(double max_norm, double norm_type) {
  // Shards are disjoint within the shard group and identical across replicas.
  std::vector<at::Tensor> grads;
  for (auto& u : units_) grads.push_back(u->flat->shard().grad());
  return sharding::ClipGradNorm(grads, max_norm, norm_type, shard_group_);
}

ShardedModel::FullParamsScope::FullParamsScope(ShardedModel* m, bool writeback) : m_(m), writeback_(writeback) {
  ST_CHECK_ARG(!writeback || m->param_dtype_ == at::kFloat,
               "SummonFullParams(writeback=true) needs float32 parameters; param_dtype is ", m->param_dtype_);
  m_->gather_order_->Forget();  // the shards may have changed since a forward: gather after everything
  for (auto& u : m_->units_) m_->Unshard(u.get());
  for (auto& u : m_->units_) m_->WaitUnshard(u.get());
}

ShardedModel::FullParamsScope::~FullParamsScope() noexcept(false) {
  at::NoGradGuard no_grad;
  for (auto& u : m_->units_) {
    if (writeback_ && !u->aliased) {
      u->flat->shard().detach().copy_(u->full.narrow(0, u->flat->shard_offset(), u->flat->shard_numel()));
    }
    m_->Reshard(u.get());
  }
}

}  // namespace shardtrain::sharding
