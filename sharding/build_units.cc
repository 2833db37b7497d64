// Building a ShardedModel's units: which parameters each unit flattens
// (wrap points, weights tied across modules, frozen parameters last, shards
// made at construction by a ShardedInitScope), and each unit's runtime views.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "base/errors.h"
#include "base/logging.h"
#include "sharding/flat_parameter.h"
#include "sharding/grad_ready_hook.h"
#include "sharding/internal/sharded_unit.h"
#include "sharding/sharded_init.h"
#include "sharding/sharded_model.h"

namespace shardtrain::sharding {
namespace internal {

// Decides which parameters each unit flattens. A tensor registered in several
// modules (tied weights) is one parameter with several names, and it belongs
// to the innermost unit whose subtree holds all of them, which is gathered
// whenever any of its users runs. Shards made at construction
// (ShardedInitScope) are adopted as they are when the unit built here has the
// same parameters in the same order, else gathered back (one unit at a time)
// so the unit is built as usual.
class UnitCollector {
 public:
  UnitCollector(torch::nn::Module& root, comm::CommunicatorPtr shard_group, bool offload);
  // The units of the wrap points the policy accepts, in registration (pre-)order.
  std::vector<std::unique_ptr<ShardedUnit>> WrappedUnits(const WrapPolicy& policy,
                                                         const std::function<bool(const WrapPoint&)>& checkpoint);
  // The root unit: every parameter no wrapped unit took. Call after WrappedUnits.
  std::unique_ptr<ShardedUnit> RootUnit();

 private:
  using Modules = std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>;
  std::vector<FlatParamEntry> UnitParams(torch::nn::Module& m, const std::string& path) const;
  void Restore(WrapPoint* wp, const std::string& path);
  void Materialise(const std::vector<FlatParamEntry>& entries);
  static bool Matches(const std::vector<FlatParamEntry>& entries, const PrebuiltUnit& pre);
  static bool Inside(const std::string& path, const std::string& root);

  torch::nn::Module& root_;
  comm::CommunicatorPtr shard_group_;
  bool offload_;
  Modules modules_;  // with their paths, parents before children
  std::unordered_map<const at::TensorImpl*, std::vector<std::string>> names_;   // every name of a parameter
  std::unordered_map<const at::TensorImpl*, std::vector<std::string>> owners_;  // modules registering it
  std::unordered_set<const at::TensorImpl*> taken_;
  std::unordered_map<const at::TensorImpl*, std::pair<WrapPoint*, std::string>> prebuilt_owner_;
};

UnitCollector::UnitCollector(torch::nn::Module& root, comm::CommunicatorPtr shard_group, bool offload)
    : root_(root), shard_group_(std::move(shard_group)), offload_(offload) {
  for (const auto& item : root_.named_modules()) modules_.emplace_back(item.key(), item.value());
  for (const auto& [path, m] : modules_) {
    for (const auto& item : m->named_parameters(/*recurse=*/false)) {
      const at::TensorImpl* impl = item.value().unsafeGetTensorImpl();
      names_[impl].push_back(path.empty() ? item.key() : path + "." + item.key());
      owners_[impl].push_back(path);
    }
  }
  for (const auto& [path, m] : modules_) {
    auto* wp = dynamic_cast<WrapPoint*>(m.get());
    if (!wp || !wp->prebuilt_) continue;
    const auto& place = wp->prebuilt_->place;
    ST_CHECK_ARG(place.rank == shard_group_->rank() && place.size == shard_group_->size(), "wrap point '", path,
                 "' was sharded at construction for shard rank ", place.rank, " of ", place.size,
                 ", but this ShardedModel's shard group makes this rank ", shard_group_->rank(), " of ",
                 shard_group_->size(), "; make the ShardedInitScope from the same world, sharding options and ",
                 "local world size as the ShardedModel");
    for (const auto& e : wp->prebuilt_->entries) prebuilt_owner_[e.param.unsafeGetTensorImpl()] = {wp, path};
  }
}

bool UnitCollector::Inside(const std::string& path, const std::string& root) {
  return root.empty() || path == root ||
         (path.size() > root.size() && path.compare(0, root.size(), root) == 0 && path[root.size()] == '.');
}

// Parameters of the subtree at `path` not taken by a nested unit and used
// only inside it; trainable ones first (stable), so a unit's frozen
// parameters sit at the end of its flat buffer, outside the optimizer's view.
std::vector<FlatParamEntry> UnitCollector::UnitParams(torch::nn::Module& m, const std::string& path) const {
  std::vector<FlatParamEntry> entries;
  for (const auto& item : m.named_parameters(true)) {
    const at::TensorImpl* impl = item.value().unsafeGetTensorImpl();
    if (taken_.count(impl)) continue;
    const auto& users = owners_.at(impl);
    if (!std::all_of(users.begin(), users.end(), [&](const std::string& u) { return Inside(u, path); })) continue;
    if (std::any_of(entries.begin(), entries.end(),
                    [&](const FlatParamEntry& e) { return e.param.unsafeGetTensorImpl() == impl; })) {
      continue;  // tied within this subtree: one entry
    }
    const auto& all = names_.at(impl);
    FlatParamEntry e;
    e.name = all.front();
    e.aliases.assign(all.begin() + 1, all.end());
    e.param = item.value();
    e.requires_grad = item.value().requires_grad();
    entries.push_back(std::move(e));
  }
  std::stable_partition(entries.begin(), entries.end(), [](const FlatParamEntry& e) { return e.requires_grad; });
  return entries;
}

// Gathers a wrap point's construction-time shard back into its parameters.
void UnitCollector::Restore(WrapPoint* wp, const std::string& path) {
  auto pre = std::move(wp->prebuilt_);
  at::NoGradGuard no_grad;
  at::Tensor full = at::empty({pre->padded_numel}, pre->shard.options());
  if (shard_group_->size() == 1) {
    full.copy_(pre->shard);
  } else {
    shard_group_->AllGather(pre->shard, full)->Wait();
  }
  int64_t offset = 0;
  for (const auto& e : pre->entries) {
    e.param.set_data(full.narrow(0, offset, e.numel).view(e.shape));
    offset += e.numel;
  }
  ST_LOG(INFO) << "ShardedModel: wrap point '" << path << "' was sharded at construction, but the unit built here "
               << "holds other parameters (a weight tied or frozen after construction, or another wrap policy); "
               << "gathered its " << pre->numel << " parameters to build the unit";
}

// Gives values back to parameters whose shard was made elsewhere before they are flattened.
void UnitCollector::Materialise(const std::vector<FlatParamEntry>& entries) {
  for (const auto& e : entries) {
    if (!StorageIsFreed(e.param)) continue;
    auto it = prebuilt_owner_.find(e.param.unsafeGetTensorImpl());
    ST_CHECK_ARG(it != prebuilt_owner_.end() && it->second.first->prebuilt_, "parameter '", e.name,
                 "' holds no values (its storage is freed) and no wrap point sharded it at construction; "
                 "a module can be wrapped by a ShardedModel only once");
    Restore(it->second.first, it->second.second);
  }
}

bool UnitCollector::Matches(const std::vector<FlatParamEntry>& entries, const PrebuiltUnit& pre) {
  if (entries.size() != pre.entries.size()) return false;
  for (size_t k = 0; k < entries.size(); ++k) {
    if (entries[k].param.unsafeGetTensorImpl() != pre.entries[k].param.unsafeGetTensorImpl() ||
        entries[k].requires_grad != pre.entries[k].requires_grad) {
      return false;
    }
  }
  return true;
}

std::vector<std::unique_ptr<ShardedUnit>> UnitCollector::WrappedUnits(
    const WrapPolicy& policy, const std::function<bool(const WrapPoint&)>& checkpoint) {
  std::vector<std::unique_ptr<ShardedUnit>> units;
  // Deepest wrap points first so nested units take their parameters before parents.
  for (auto it = modules_.rbegin(); it != modules_.rend(); ++it) {
    auto* wp = dynamic_cast<WrapPoint*>(it->second.get());
    if (!wp || it->second.get() == &root_) continue;
    ST_CHECK_ARG(wp->unit_ == nullptr, "wrap point '", it->first, "' is already a unit of another ShardedModel");
    auto entries = UnitParams(*it->second, it->first);
    int64_t numel = 0;
    for (auto& e : entries) numel += e.param.numel();
    const bool wrap = !entries.empty() && policy.should_wrap(*wp, numel);
    std::shared_ptr<PrebuiltUnit> adopt;
    if (wp->prebuilt_ && wrap && Matches(entries, *wp->prebuilt_)) adopt = std::move(wp->prebuilt_);
    if (wp->prebuilt_) Restore(wp, it->first);
    if (!wrap) continue;
    auto u = std::make_unique<ShardedUnit>();
    u->name = it->first;
    u->checkpoint = checkpoint && checkpoint(*wp);
    for (auto& e : entries) taken_.insert(e.param.unsafeGetTensorImpl());
    if (adopt) {
      u->flat = FlatParameter::FromShard(u->name, std::move(entries), adopt->shard, shard_group_->rank(),
                                         shard_group_->size(), offload_);
    } else {
      Materialise(entries);
      u->flat = std::make_unique<FlatParameter>(u->name, std::move(entries), shard_group_->rank(),
                                                shard_group_->size(), offload_);
    }
    wp->unit_ = u.get();
    units.push_back(std::move(u));
  }
  // Units were created deepest-first; keep registration (pre-)order instead.
  std::reverse(units.begin(), units.end());
  return units;
}

std::unique_ptr<ShardedUnit> UnitCollector::RootUnit() {
  auto root = std::make_unique<ShardedUnit>();
  root->is_root = true;
  root->name = "";
  auto entries = UnitParams(root_, "");
  Materialise(entries);
  for (const auto& [path, m] : modules_) {  // shards of parameters no unit holds any more
    if (auto* wp = dynamic_cast<WrapPoint*>(m.get())) wp->prebuilt_.reset();
  }
  root->flat = std::make_unique<FlatParameter>("<root>", std::move(entries), shard_group_->rank(),
                                               shard_group_->size(), offload_);
  return root;
}

}  // namespace internal

void ShardedModel::BuildUnits(const WrapPolicy& policy, const std::function<bool(const WrapPoint&)>& checkpoint) {
  internal::UnitCollector collector(*module_, shard_group_, options_.offload_params);
  units_ = collector.WrappedUnits(policy, checkpoint);
  auto root = collector.RootUnit();
  root_ = root.get();
  units_.push_back(std::move(root));
  const auto placed = std::find_if(units_.begin(), units_.end(), [](const auto& u) { return u->flat->numel() > 0; });
  for (auto& u : units_) {
    if (placed != units_.end() && u->flat->numel() == 0) {
      u->flat->PlaceEmptyOn((*placed)->flat->device(), options_.offload_params);
    }
  }
  for (size_t i = 0; i < units_.size(); ++i) InitUnitRuntime(units_[i].get(), static_cast<int>(i));
  if (options_.use_orig_params) BuildOrigParamViews();
  int64_t total = 0;
  for (auto& u : units_) total += u->flat->numel();
  ST_LOG(INFO) << "ShardedModel: " << units_.size() << " units (" << units_.size() - 1 << " wrapped + root), "
               << total << " parameters, strategy " << ShardingStrategyName(options_.sharding_strategy)
               << ", shard group " << shard_group_->size() << ", replicate group "
               << (replicate_group_ ? replicate_group_->size() : 1);
}

// The unit's full-parameter buffer (freed until gathered), the parameters as
// views of it, gradient-ready hooks, and the optimizer's tensor.
void ShardedModel::InitUnitRuntime(ShardedUnit* u, int index) {
  u->model = this;
  u->index = index;
  const int64_t padded = u->flat->padded_numel();
  u->aliased = shard_group_->size() == 1 && !options_.force_collectives && param_dtype_ == at::kFloat &&
               u->flat->shard().device() == u->flat->device();
  if (u->aliased) {
    u->full = u->flat->shard().detach();
    u->state = ShardedUnit::State::kGathered;
  } else {
    u->full = at::empty({padded}, at::TensorOptions().dtype(param_dtype_).device(u->flat->device()));
  }
  u->param_views = u->flat->Views(u->full);  // views are made while storage exists (bounds checks)
  if (!u->aliased) FreeStorage(u->full);
  const auto& entries = u->flat->entries();
  for (size_t k = 0; k < entries.size(); ++k) {
    at::Tensor p = entries[k].param;
    p.set_data(u->param_views[k]);
    if (entries[k].requires_grad) {
      u->accumulators.push_back(OnGradientReady(p, alive_, [this, u, k] { OnGradReady(u, k); }));
      ++u->trainable;
    }
  }
  int64_t trainable_numel = 0;  // trainable entries come first: [0, trainable_numel) of the flat buffer
  for (const auto& e : entries) trainable_numel += e.requires_grad ? e.numel : 0;
  if (trainable_numel == u->flat->numel()) {
    u->opt_param = u->flat->shard();
  } else {
    const int64_t n = std::clamp<int64_t>(trainable_numel - u->flat->shard_offset(), 0, u->flat->shard_numel());
    u->opt_param = internal::AliasRange(u->flat->shard(), 0, n, /*requires_grad=*/true);
  }
}

// use_orig_params: each trainable parameter's part of this rank's shard as its own leaf.
void ShardedModel::BuildOrigParamViews() {
  for (auto& u : units_) {
    const int64_t lo = u->flat->shard_offset(), hi = lo + u->flat->shard_numel();
    for (const auto& e : u->flat->entries()) {
      const int64_t b = std::max(lo, e.offset), end = std::min(hi, e.offset + e.numel);
      if (end <= b || !e.requires_grad) continue;
      orig_param_views_.emplace_back(e.name,
                                     internal::AliasRange(u->flat->shard(), b - lo, end - b, /*requires_grad=*/true));
      orig_view_ranges_.push_back({u->index, {b - lo, end - b}});
    }
  }
}

}  // namespace shardtrain::sharding
