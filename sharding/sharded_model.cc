#include "sharding/sharded_model.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cxxabi.h>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "base/errors.h"
#include "base/logging.h"
#include "sharding/flat_parameter.h"
#include "sharding/grad_ready_hook.h"
#include "sharding/shard_layout.h"
#include "sharding/sharded_init.h"

namespace shardtrain::sharding {

// ---------------------------------------------------------------------------
// Wrap policies

WrapPolicy WrapPolicy::Always() {
  return {[](const WrapPoint&, int64_t) { return true; }};
}
WrapPolicy WrapPolicy::Never() {
  return {[](const WrapPoint&, int64_t) { return false; }};
}
WrapPolicy WrapPolicy::SizeBased(int64_t min_num_params) {
  ST_CHECK_ARG(min_num_params >= 0, "min_num_params must be >= 0, got ", min_num_params);
  return {[min_num_params](const WrapPoint&, int64_t numel) { return numel >= min_num_params; }};
}
WrapPolicy WrapPolicy::ByType(std::vector<std::string> type_names) {
  return {[names = std::move(type_names)](const WrapPoint& p, int64_t) {
    const std::string t = p.WrapTypeName();
    for (const auto& n : names) {
      if (t == n || (t.size() > n.size() && t.compare(t.size() - n.size(), n.size(), n) == 0 &&
                     t[t.size() - n.size() - 1] == ':')) {
        return true;
      }
    }
    return false;
  }};
}

namespace internal {
std::string Demangle(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = (status == 0 && d) ? d : name;
  std::free(d);
  return out;
}
}  // namespace internal

// ---------------------------------------------------------------------------
// ShardedUnit: one unit's runtime state.

class ShardedUnit {
 public:
  enum class State { kSharded, kGathering, kGathered };

  ShardedModel* model = nullptr;
  int index = 0;
  std::string name;
  bool is_root = false;
  bool checkpoint = false;
  std::unique_ptr<FlatParameter> flat;
  // What the optimizer steps: the shard itself, or, when the unit holds
  // frozen parameters (laid out after the trainable ones), a leaf viewing
  // only the shard's trainable prefix, so no optimizer (weight decay,
  // momentum) ever touches a frozen element.
  at::Tensor opt_param;
  at::Tensor full;      // gathered parameters in param dtype
  bool aliased = false;  // shard group of one and float32: `full` is the shard itself
  State state = State::kSharded;
  comm::WorkPtr gather_work;
  at::Tensor gather_input;
  std::vector<at::Tensor> param_views;  // views of `full`, one per entry
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  int trainable = 0;

  // Per backward.
  at::Tensor flat_grad;
  std::vector<at::Tensor> grad_views;
  std::vector<bool> grad_written;  // grad_views[k] holds this accumulation's gradient
  bool grads_armed = false;
  bool pre_backward_done = false;
  int grads_pending = 0;
  bool ready = false;
  bool launched = false;
  comm::WorkPtr reduce_work;
  at::Tensor reduce_in;
  at::Tensor reduce_out;

};

namespace {

// Adds the wall time of its scope to *total.
class Stopwatch {
 public:
  explicit Stopwatch(double* total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~Stopwatch() { *total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  double* total_;
  std::chrono::steady_clock::time_point start_;
};

// Activation checkpointing: forward without saving activations, recompute the
// unit's forward in backward (its parameters were re-gathered by then).
// One run of a checkpointed forward: what backward needs besides the inputs.
struct CheckpointRun : torch::CustomClassHolder {
  WrapPoint::TensorsFn fn;
  at::Tensor rng_state;  // default CPU generator before the forward
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `anchor` requires grad so that the outputs do even when no input does
  // (the unit's parameters are not inputs of this Function).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                const at::Tensor& anchor, const c10::intrusive_ptr<CheckpointRun>& run) {
    run->rng_state = at::detail::getDefaultCPUGenerator().get_state();
    ctx->saved_data["run"] = c10::IValue::make_capsule(run);
    ctx->save_for_backward(inputs.vec());
    at::NoGradGuard no_grad;
    auto outputs = run->fn(inputs.vec());
    for (const auto& o : outputs) {
      if (o.defined() && !at::isFloatingType(o.scalar_type()) && !at::isComplexType(o.scalar_type())) {
        ctx->mark_non_differentiable({o});
      }
    }
    return outputs;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    // saved_data keeps the run alive.
    auto* run = static_cast<CheckpointRun*>(ctx->saved_data["run"].toCapsule().get());
    std::vector<at::Tensor> xs;
    for (const auto& input : ctx->get_saved_variables()) {
      xs.push_back(input.defined() ? input.detach().set_requires_grad(input.requires_grad()) : input);
    }
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor rng_now = gen.get_state();
    gen.set_state(run->rng_state);
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode enable(true);
      outputs = run->fn(xs);
    }
    gen.set_state(rng_now);
    // Backpropagate through the outputs that carry a gradient (unused outputs
    // and ones that do not depend on anything trainable carry none).
    std::vector<at::Tensor> outs, grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        outs.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!outs.empty()) torch::autograd::backward(outs, grads);
    torch::autograd::variable_list result;
    for (const auto& x : xs) result.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    result.push_back(at::Tensor());  // anchor
    result.push_back(at::Tensor());  // run
    return result;
  }
};

std::mutex g_sharded_modules_mu;
std::unordered_set<const torch::nn::Module*> g_sharded_modules;

bool IsFloating(const at::Tensor& t) { return at::isFloatingType(t.scalar_type()); }

// A separate tensor (not an autograd view) over [offset, offset + len) of
// `base`'s elements, sharing its storage: optimizer leaves over parts of a
// shard, and their gradients over parts of the shard's gradient.
at::Tensor AliasRange(const at::Tensor& base, int64_t offset, int64_t len, bool requires_grad = false) {
  at::Tensor v = at::empty({0}, base.options().requires_grad(false));
  v.set_(base.storage(), base.storage_offset() + offset, {len}, {1});
  if (requires_grad) v.set_requires_grad(true);
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------
// WrapPoint

void WrapPoint::PreForward() { unit_->model->UnitPreForward(unit_); }
void WrapPoint::PostForward(const std::vector<at::Tensor>& outputs) { unit_->model->UnitPostForward(unit_, outputs); }
bool WrapPoint::checkpointing() const { return unit_ && unit_->model->UnitCheckpointing(unit_); }

void WrapPoint::CheckpointUnsupported(const std::string& why) const {
  ST_THROW(InvalidArgumentError, "activation checkpointing of unit '", unit_ ? unit_->name : std::string("?"), "' (",
           WrapTypeName(), ") is not possible: ", why,
           "; leave this module type out of the activation checkpointing policy");
}

std::vector<at::Tensor> WrapPoint::MaybeCheckpoint(const std::vector<at::Tensor>& inputs, const TensorsFn& fn) {
  if (!checkpointing() || !at::GradMode::is_enabled()) return fn(inputs);
  auto run = c10::make_intrusive<CheckpointRun>();
  run->fn = fn;
  static const at::Tensor anchor = at::empty({0}).set_requires_grad(true);
  return CheckpointFunction::apply(at::TensorList(inputs), anchor, run);
}

// ---------------------------------------------------------------------------
// ShardedModel

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> module, comm::CommunicatorPtr world,
                           ShardingOptions options, WrapPolicy policy,
                           std::function<bool(const WrapPoint&)> checkpoint, int local_world_size)
    : module_(std::move(module)), world_(std::move(world)), options_(options) {
  ST_CHECK_ARG(module_ != nullptr, "ShardedModel needs a module");
  ST_CHECK_ARG(world_ != nullptr, "ShardedModel needs a communicator");
  ST_CHECK_ARG(options_.limit_all_gathers >= 0, "limit_all_gathers must be >= 0 (0 = unlimited), got ",
               options_.limit_all_gathers);
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
  const auto& mp = options_.mixed_precision;
  param_dtype_ = mp.param_dtype.value_or(at::kFloat);
  reduce_dtype_ = options_.fp32_reduce_scatter ? at::kFloat : mp.reduce_dtype.value_or(param_dtype_);
  for (auto dt : {param_dtype_, reduce_dtype_}) {
    ST_CHECK_ARG(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                 "mixed_precision dtypes must be float32, bfloat16 or float16, got ", dt);
  }

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
      int s = options_.hybrid_shard_group_size > 0 ? options_.hybrid_shard_group_size
              : local_world_size > 0               ? local_world_size
                                                   : W;
      ST_CHECK_ARG(W % s == 0, "HYBRID_SHARD: shard group size ", s, " must divide the world size ", W);
      auto groups = world_->SplitHybrid(s);
      shard_group_ = groups.shard;
      if (W / s > 1) replicate_group_ = groups.replicate;
      break;
    }
  }
  // Gradient averaging over the whole world, split before/after the sum like PyTorch.
  if (options_.gradient_predivide_factor > 0 || options_.gradient_postdivide_factor > 0) {
    pre_divide_ = options_.gradient_predivide_factor > 0 ? options_.gradient_predivide_factor : 1.0;
    post_divide_ = options_.gradient_postdivide_factor > 0 ? options_.gradient_postdivide_factor : W / pre_divide_;
  } else {
    int factor = 1;
    while (W % factor == 0 && W / factor > factor) factor *= 2;
    pre_divide_ = factor;
    post_divide_ = static_cast<double>(W) / factor;
  }

  if (options_.sync_module_states) SyncModuleStates();
  if (mp.buffer_dtype) {
    for (auto& b : module_->buffers()) {
      if (IsFloating(b)) b.set_data(b.to(*mp.buffer_dtype));
    }
  }
  BuildUnits(policy, checkpoint);
  unregister.armed = false;
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

void ShardedModel::BuildUnits(const WrapPolicy& policy, const std::function<bool(const WrapPoint&)>& checkpoint) {
  // Collect modules with their paths, parents before children.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules;
  for (const auto& item : module_->named_modules()) modules.emplace_back(item.key(), item.value());
  // Every name of every parameter, and the modules that register it: a tensor
  // registered in several modules (tied weights) is one parameter with several
  // names, and it belongs to the innermost unit whose subtree holds all of
  // them, which is gathered whenever any of its users runs.
  std::unordered_map<const at::TensorImpl*, std::vector<std::string>> names;
  std::unordered_map<const at::TensorImpl*, std::vector<std::string>> owners;
  for (const auto& [path, m] : modules) {
    for (const auto& item : m->named_parameters(/*recurse=*/false)) {
      const at::TensorImpl* impl = item.value().unsafeGetTensorImpl();
      names[impl].push_back(path.empty() ? item.key() : path + "." + item.key());
      owners[impl].push_back(path);
    }
  }
  auto inside = [](const std::string& path, const std::string& root) {
    return root.empty() || path == root || (path.size() > root.size() && path.compare(0, root.size(), root) == 0 &&
                                            path[root.size()] == '.');
  };
  std::unordered_set<const at::TensorImpl*> taken;
  // Parameters of the subtree at `path` not taken by a nested unit and used
  // only inside it; trainable ones first (stable), so a unit's frozen
  // parameters sit at the end of its flat buffer, outside the optimizer's view.
  auto unit_params = [&](torch::nn::Module& m, const std::string& path) {
    std::vector<FlatParamEntry> entries;
    for (const auto& item : m.named_parameters(true)) {
      const at::TensorImpl* impl = item.value().unsafeGetTensorImpl();
      if (taken.count(impl)) continue;
      const auto& users = owners.at(impl);
      if (!std::all_of(users.begin(), users.end(), [&](const std::string& u) { return inside(u, path); })) continue;
      if (std::any_of(entries.begin(), entries.end(), [&](const FlatParamEntry& e) {
            return e.param.unsafeGetTensorImpl() == impl;
          })) {
        continue;  // tied within this subtree: one entry
      }
      const auto& all = names.at(impl);
      FlatParamEntry e;
      e.name = all.front();
      e.aliases.assign(all.begin() + 1, all.end());
      e.param = item.value();
      e.requires_grad = item.value().requires_grad();
      entries.push_back(std::move(e));
    }
    std::stable_partition(entries.begin(), entries.end(), [](const FlatParamEntry& e) { return e.requires_grad; });
    return entries;
  };
  // Shards made at construction (ShardedInitScope): adopted as they are when
  // the unit built here has the same parameters in the same order, else
  // gathered back (one unit at a time) so the unit is built as usual.
  std::unordered_map<const at::TensorImpl*, std::pair<WrapPoint*, std::string>> prebuilt_owner;
  for (const auto& [path, m] : modules) {
    auto* wp = dynamic_cast<WrapPoint*>(m.get());
    if (!wp || !wp->prebuilt_) continue;
    const auto& place = wp->prebuilt_->place;
    ST_CHECK_ARG(place.rank == shard_group_->rank() && place.size == shard_group_->size(), "wrap point '", path,
                 "' was sharded at construction for shard rank ", place.rank, " of ", place.size,
                 ", but this ShardedModel's shard group makes this rank ", shard_group_->rank(), " of ",
                 shard_group_->size(), "; make the ShardedInitScope from the same world, sharding options and ",
                 "local world size as the ShardedModel");
    for (const auto& e : wp->prebuilt_->entries) prebuilt_owner[e.param.unsafeGetTensorImpl()] = {wp, path};
  }
  auto restore = [&](WrapPoint* wp, const std::string& path) {
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
  };
  // Gives values back to parameters whose shard was made elsewhere before they are flattened.
  auto materialise = [&](const std::vector<FlatParamEntry>& entries) {
    for (const auto& e : entries) {
      if (!StorageIsFreed(e.param)) continue;
      auto it = prebuilt_owner.find(e.param.unsafeGetTensorImpl());
      ST_CHECK_ARG(it != prebuilt_owner.end() && it->second.first->prebuilt_, "parameter '", e.name,
                   "' holds no values (its storage is freed) and no wrap point sharded it at construction; "
                   "a module can be wrapped by a ShardedModel only once");
      restore(it->second.first, it->second.second);
    }
  };
  auto matches = [](const std::vector<FlatParamEntry>& entries, const internal::PrebuiltUnit& pre) {
    if (entries.size() != pre.entries.size()) return false;
    for (size_t k = 0; k < entries.size(); ++k) {
      if (entries[k].param.unsafeGetTensorImpl() != pre.entries[k].param.unsafeGetTensorImpl() ||
          entries[k].requires_grad != pre.entries[k].requires_grad) {
        return false;
      }
    }
    return true;
  };
  // Deepest wrap points first so nested units take their parameters before parents.
  for (auto it = modules.rbegin(); it != modules.rend(); ++it) {
    auto* wp = dynamic_cast<WrapPoint*>(it->second.get());
    if (!wp || it->second.get() == module_.get()) continue;
    ST_CHECK_ARG(wp->unit_ == nullptr, "wrap point '", it->first, "' is already a unit of another ShardedModel");
    auto entries = unit_params(*it->second, it->first);
    int64_t numel = 0;
    for (auto& e : entries) numel += e.param.numel();
    const bool wrap = !entries.empty() && policy.should_wrap(*wp, numel);
    std::shared_ptr<internal::PrebuiltUnit> adopt;
    if (wp->prebuilt_ && wrap && matches(entries, *wp->prebuilt_)) adopt = std::move(wp->prebuilt_);
    if (wp->prebuilt_) restore(wp, it->first);
    if (!wrap) continue;
    auto u = std::make_unique<ShardedUnit>();
    u->name = it->first;
    u->checkpoint = checkpoint && checkpoint(*wp);
    for (auto& e : entries) taken.insert(e.param.unsafeGetTensorImpl());
    if (adopt) {
      u->flat = FlatParameter::FromShard(u->name, std::move(entries), adopt->shard, shard_group_->rank(),
                                         shard_group_->size(), options_.offload_params);
    } else {
      materialise(entries);
      u->flat = std::make_unique<FlatParameter>(u->name, std::move(entries), shard_group_->rank(),
                                                shard_group_->size(), options_.offload_params);
    }
    wp->unit_ = u.get();
    units_.push_back(std::move(u));
  }
  // Units were created deepest-first; keep registration (pre-)order instead.
  std::reverse(units_.begin(), units_.end());
  auto root = std::make_unique<ShardedUnit>();
  root->is_root = true;
  root->name = "";
  auto root_entries = unit_params(*module_, "");
  materialise(root_entries);
  for (const auto& [path, m] : modules) {  // shards of parameters no unit holds any more
    if (auto* wp = dynamic_cast<WrapPoint*>(m.get())) wp->prebuilt_.reset();
  }
  root->flat = std::make_unique<FlatParameter>("<root>", std::move(root_entries), shard_group_->rank(),
                                               shard_group_->size(), options_.offload_params);
  root_ = root.get();
  units_.push_back(std::move(root));

  for (size_t i = 0; i < units_.size(); ++i) {
    ShardedUnit* u = units_[i].get();
    u->model = this;
    u->index = static_cast<int>(i);
    const int64_t padded = u->flat->padded_numel();
    u->aliased = shard_group_->size() == 1 && param_dtype_ == at::kFloat &&
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
      u->opt_param = AliasRange(u->flat->shard(), 0, n, /*requires_grad=*/true);
    }
  }
  if (options_.use_orig_params) {
    for (auto& u : units_) {
      const int64_t lo = u->flat->shard_offset(), hi = lo + u->flat->shard_numel();
      for (const auto& e : u->flat->entries()) {
        const int64_t b = std::max(lo, e.offset), end = std::min(hi, e.offset + e.numel);
        if (end <= b || !e.requires_grad) continue;
        orig_param_views_.emplace_back(e.name,
                                       AliasRange(u->flat->shard(), b - lo, end - b, /*requires_grad=*/true));
        orig_view_ranges_.push_back({u->index, {b - lo, end - b}});
      }
    }
  }
  int64_t total = 0;
  for (auto& u : units_) total += u->flat->numel();
  ST_LOG(INFO) << "ShardedModel: " << units_.size() << " units (" << units_.size() - 1 << " wrapped + root), "
               << total << " parameters, strategy " << ShardingStrategyName(options_.sharding_strategy)
               << ", shard group " << shard_group_->size() << ", replicate group "
               << (replicate_group_ ? replicate_group_->size() : 1);
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
  for (auto& u : units_) n += u->flat_grad.defined() || u->reduce_in.defined();
  return n;
}

std::vector<std::string> ShardedModel::UnshardedUnitNames() const {
  std::vector<std::string> out;
  for (auto& u : units_) {
    if (!u->aliased && u->state != ShardedUnit::State::kSharded) out.push_back(u->is_root ? "<root>" : u->name);
  }
  return out;
}

// --- gathering ---------------------------------------------------------------

void ShardedModel::Unshard(ShardedUnit* u) {
  if (u->state != ShardedUnit::State::kSharded) return;
  AllocateStorage(u->full);
  at::Tensor shard = u->flat->shard().detach();
  if (shard_group_->size() == 1) {
    u->full.copy_(shard, /*non_blocking=*/true);
    u->state = ShardedUnit::State::kGathered;
    return;
  }
  // From an offloaded (CPU) shard this is an asynchronous host-to-device copy
  // on the compute stream, which the communicator's stream waits for.
  u->gather_input = shard.to(u->full.device(), param_dtype_, /*non_blocking=*/true);
  {
    Stopwatch sw(&comm_times_.gather_issue_s);
    u->gather_work = shard_group_->AllGather(u->gather_input, u->full);
  }
  u->state = ShardedUnit::State::kGathering;
}

void ShardedModel::WaitUnshard(ShardedUnit* u) {
  if (u->state == ShardedUnit::State::kGathering) {
    Stopwatch sw(&comm_times_.gather_wait_s);
    u->gather_work->Wait();
    u->gather_work.reset();
    u->gather_input = at::Tensor();
    u->state = ShardedUnit::State::kGathered;
  }
}

void ShardedModel::Reshard(ShardedUnit* u) {
  if (u->aliased || u->state == ShardedUnit::State::kSharded) return;
  WaitUnshard(u);
  FreeStorage(u->full);
  u->state = ShardedUnit::State::kSharded;
}

void ShardedModel::Prefetch(ShardedUnit* u, bool backward) {
  if (!order_recorded_ || u->is_root) return;
  auto it = std::find(forward_order_.begin(), forward_order_.end(), u);
  if (it == forward_order_.end()) return;
  ShardedUnit* next = nullptr;
  if (backward) {
    if (it != forward_order_.begin()) next = *(it - 1);
  } else if (it + 1 != forward_order_.end()) {
    next = *(it + 1);
  }
  if (!next || next->state != ShardedUnit::State::kSharded) return;
  if (backward && (next->launched || next->ready)) return;
  if (options_.limit_all_gathers > 0) {
    int in_flight = 0;
    for (auto& x : units_) {
      if (!x->is_root && !x->aliased && x->state != ShardedUnit::State::kSharded) ++in_flight;
    }
    if (in_flight >= options_.limit_all_gathers) return;
  }
  Unshard(next);
}

// --- forward -----------------------------------------------------------------

void ShardedModel::BeginForward() {
  if (callback_queued_ || next_launch_ > 0) {
    // A previous backward did not finish (an exception inside it): start clean.
    ResetIteration();
  }
  Unshard(root_);
  WaitUnshard(root_);
}

void ShardedModel::EndForward(const std::vector<at::Tensor>& outputs) {
  order_recorded_ = true;
  if (!at::GradMode::is_enabled()) {
    for (auto& u : units_) Reshard(u.get());
    return;
  }
  // Root parameters (e.g. a tied output head) receive gradients first in backward.
  ArmGrads(root_);
  root_->pre_backward_done = true;
  for (const auto& t : outputs) {
    if (t.defined() && t.requires_grad()) {
      t.register_hook([this](const at::Tensor&) { EnsureBackwardCallback(); });
    }
  }
}

void ShardedModel::UnitPreForward(ShardedUnit* u) {
  if (!order_recorded_ && std::find(forward_order_.begin(), forward_order_.end(), u) == forward_order_.end()) {
    forward_order_.push_back(u);
    reduce_order_.clear();
  }
  Unshard(u);
  if (options_.forward_prefetch) Prefetch(u, /*backward=*/false);
  WaitUnshard(u);
}

void ShardedModel::UnitPostForward(ShardedUnit* u, const std::vector<at::Tensor>& outputs) {
  if (!at::GradMode::is_enabled()) {
    Reshard(u);
    return;
  }
  bool hooked = false;
  for (const auto& t : outputs) {
    if (t.defined() && t.requires_grad()) {
      t.register_hook([this, u](const at::Tensor&) { PreBackward(u); });
      hooked = true;
    }
  }
  if (!hooked) {
    ST_LOG(WARNING) << "unit '" << u->name
                    << "': no forward output requires grad; its parameters stay gathered until backward";
    return;
  }
  if (ReshardsAfterForward()) Reshard(u);
}

// --- backward ----------------------------------------------------------------

void ShardedModel::EnsureBackwardCallback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { FinishBackward(); });
}

void ShardedModel::PreBackward(ShardedUnit* u) {
  EnsureBackwardCallback();
  if (u->pre_backward_done) return;
  u->pre_backward_done = true;
  Unshard(u);
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPre) Prefetch(u, /*backward=*/true);
  WaitUnshard(u);
  ArmGrads(u);
}

// Prepares the unit's flat gradient buffer for a backward. A fresh buffer is
// not zeroed as a whole: each parameter's first gradient of an accumulation
// is copied into its view (AccumulateGrad hands over the gradient it
// computed), so only what no gradient writes is zeroed: the padding and
// frozen parameters here, parameters that got no gradient in LaunchReduce.
// Later gradients (no_sync micro-batches) accumulate in place into the views.
void ShardedModel::ArmGrads(ShardedUnit* u) {
  if (u->grads_armed) return;
  const auto& entries = u->flat->entries();
  if (!u->flat_grad.defined()) {
    u->flat_grad = at::empty({u->flat->padded_numel()}, u->full.options().dtype(param_dtype_));
    u->grad_views = u->flat->Views(u->flat_grad);
    u->grad_written.assign(entries.size(), false);
    const int64_t numel = u->flat->numel();
    u->flat_grad.narrow(0, numel, u->flat->padded_numel() - numel).zero_();
    for (size_t k = 0; k < entries.size(); ++k) {
      if (!entries[k].requires_grad) u->grad_views[k].zero_();
      else entries[k].param.mutable_grad() = at::Tensor();  // AccumulateGrad produces a fresh one
    }
  } else {
    for (size_t k = 0; k < entries.size(); ++k) {
      if (entries[k].requires_grad && u->grad_written[k]) entries[k].param.mutable_grad() = u->grad_views[k];
    }
  }
  u->grads_pending = u->trainable;
  u->grads_armed = true;
  u->ready = u->trainable == 0;
}

void ShardedModel::OnGradReady(ShardedUnit* u, size_t entry) {
  EnsureBackwardCallback();
  ST_CHECK_ARG(!at::GradMode::is_enabled(),
               "backward with create_graph=true is not supported by sharded units (gradients are reduced in place)");
  at::Tensor& g = u->flat->entries()[entry].param.mutable_grad();
  if (!u->grads_armed) {
    // A gradient arrived before the unit's pre-backward (an output hook could
    // not be registered): arm now, keeping what AccumulateGrad produced.
    at::Tensor produced = g;
    ArmGrads(u);
    if (produced.defined()) g = produced;
  }
  at::Tensor& view = u->grad_views[entry];
  if (g.defined() && !g.is_same(view)) {
    // AccumulateGrad's fresh gradient (or a replaced one): into the flat buffer.
    if (u->grad_written[entry]) view.add_(g);
    else view.copy_(g);
    g = view;
  }
  u->grad_written[entry] = true;
  if (--u->grads_pending == 0) {
    u->ready = true;
    LaunchReadyInOrder();
  }
}

void ShardedModel::LaunchReadyInOrder() {
  if (reduce_order_.empty()) {
    // Canonical order, identical on every rank: reverse forward order, then
    // units never seen in forward, root last.
    for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it) reduce_order_.push_back(*it);
    for (auto& u : units_) {
      if (!u->is_root && std::find(reduce_order_.begin(), reduce_order_.end(), u.get()) == reduce_order_.end())
        reduce_order_.push_back(u.get());
    }
    reduce_order_.push_back(root_);
  }
  while (next_launch_ < reduce_order_.size() && reduce_order_[next_launch_]->ready) {
    LaunchReduce(reduce_order_[next_launch_]);
    ++next_launch_;
  }
}

void ShardedModel::LaunchReduce(ShardedUnit* u) {
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost) Prefetch(u, /*backward=*/true);
  u->launched = true;
  Reshard(u);
  const auto& entries = u->flat->entries();
  for (size_t k = 0; k < entries.size(); ++k) {
    if (!entries[k].requires_grad || u->grad_written[k]) continue;
    u->grad_views[k].zero_();  // no gradient this backward
    entries[k].param.mutable_grad() = u->grad_views[k];
    u->grad_written[k] = true;
  }
  if (no_sync_) return;  // keep the full gradient for the next micro-batch
  for (const auto& e : entries) {
    if (e.requires_grad) e.param.mutable_grad() = at::Tensor();
  }
  u->grad_views.clear();
  u->grad_written.clear();
  at::Tensor in = reduce_dtype_ == u->flat_grad.scalar_type() ? u->flat_grad : u->flat_grad.to(reduce_dtype_);
  u->flat_grad = at::Tensor();
  u->reduce_out = at::empty({u->flat->shard_numel()}, in.options());
  comm::ReduceOptions ro;
  ro.op = comm::ReduceOp::kSum;
  ro.pre_divide = pre_divide_;
  ro.post_divide = post_divide_;
  {
    Stopwatch sw(&comm_times_.reduce_issue_s);
    u->reduce_work = shard_group_->ReduceScatter(in, u->reduce_out, ro);
  }
  u->reduce_in = in;
  reducing_.push_back(u);
  FinishReduces(kMaxReducesInFlight);
}

// Completes reduce-scatters in launch order: every finished one, and the
// oldest ones until at most `keep` are in flight. Completing frees the unit's
// full-size gradient (so at most `keep` of them outlive their reduce-scatter)
// and, for communicators that finish a reduction on the waiting thread, spreads
// that work over backward instead of leaving it all to its end.
void ShardedModel::FinishReduces(size_t keep) {
  while (!reducing_.empty() && (reducing_.size() > keep || reducing_.front()->reduce_work->IsCompleted())) {
    ShardedUnit* u = reducing_.front();
    reducing_.pop_front();
    Stopwatch sw(&comm_times_.reduce_wait_s);
    u->reduce_work->Wait();
    u->reduce_work.reset();
    u->reduce_in = at::Tensor();
  }
}

void ShardedModel::FinishBackward() {
  // Units whose parameters got no gradient still take part, in the same order on every rank.
  if (reduce_order_.empty()) LaunchReadyInOrder();
  for (auto* u : reduce_order_) {
    if (!u->grads_armed) ArmGrads(u);
    u->ready = true;
  }
  LaunchReadyInOrder();
  FinishReduces(0);
  std::vector<comm::WorkPtr> replicate_works;
  for (auto* u : reduce_order_) {
    if (replicate_group_ && u->reduce_out.defined()) {
      replicate_works.push_back(replicate_group_->AllReduce(u->reduce_out));
    }
  }
  for (auto& w : replicate_works) w->Wait();
  // Accumulate into existing gradients (no zero_grad between backwards) or
  // start fresh. With use_orig_params the optimizer sees (and clears) the
  // per-parameter views, not the shard's gradient.
  std::vector<bool> accumulate(units_.size(), false);
  for (auto& u : units_) accumulate[u->index] = u->opt_param.grad().defined();
  if (options_.use_orig_params) {
    std::fill(accumulate.begin(), accumulate.end(), false);
    for (size_t i = 0; i < orig_param_views_.size(); ++i) {
      if (orig_param_views_[i].second.grad().defined()) accumulate[orig_view_ranges_[i].first] = true;
    }
  }
  for (auto* u : reduce_order_) {
    if (!u->reduce_out.defined()) continue;
    at::Tensor g = u->reduce_out.to(u->flat->shard().device(), at::kFloat);  // back to the CPU when offloaded
    at::Tensor shard = u->flat->shard();
    if (accumulate[u->index]) {
      shard.mutable_grad().add_(g);
    } else if (shard.grad().defined()) {
      shard.mutable_grad().copy_(g);  // keep the storage: views may alias it
    } else {
      shard.mutable_grad() = g;  // this unit's reduce_out (or its float32 copy), owned by nobody else
    }
    if (!u->opt_param.is_same(shard)) {
      // The optimizer's view of the trainable prefix sees that part of the shard's gradient.
      u->opt_param.mutable_grad() = AliasRange(shard.grad(), 0, u->opt_param.numel());
    }
    u->reduce_out = at::Tensor();
  }
  for (auto& u : units_) {
    Reshard(u.get());
    u->grads_armed = false;
    u->pre_backward_done = false;
    u->ready = false;
    u->launched = false;
  }
  next_launch_ = 0;
  callback_queued_ = false;
  // Under no_sync nothing was reduced: the shard gradient may be last step's,
  // which must not reappear as the parameters' gradients.
  if (!no_sync_) RealiasOrigParamGrads();
}

void ShardedModel::ResetIteration() {
  for (auto& u : units_) {
    if (u->reduce_work) {
      try {
        u->reduce_work->Wait();
      } catch (...) {
      }
    }
    u->reduce_work.reset();
    u->reduce_in = u->reduce_out = at::Tensor();
    u->grads_armed = u->pre_backward_done = u->ready = u->launched = false;
    Reshard(u.get());
  }
  reducing_.clear();
  next_launch_ = 0;
  callback_queued_ = false;
}

void ShardedModel::RealiasOrigParamGrads() {
  if (!options_.use_orig_params) return;
  for (size_t i = 0; i < orig_param_views_.size(); ++i) {
    const auto& [unit, range] = orig_view_ranges_[i];
    at::Tensor g = units_[unit]->flat->shard().grad();
    if (!g.defined()) continue;
    orig_param_views_[i].second.mutable_grad() = AliasRange(g, range.first, range.second);
  }
}

ShardedModel::NoSyncScope::NoSyncScope(ShardedModel* m) : m_(m), prev_(m->no_sync_) { m_->no_sync_ = true; }
ShardedModel::NoSyncScope::~NoSyncScope() { m_->no_sync_ = prev_; }

// --- utilities ---------------------------------------------------------------

double ShardedModel::ClipGradNorm(double max_norm, double norm_type) {
  ST_CHECK_ARG(max_norm > 0, "ClipGradNorm: max_norm must be > 0, got ", max_norm);
  const bool inf = std::isinf(norm_type);
  ST_CHECK_ARG(inf || norm_type == 2.0, "ClipGradNorm: norm_type must be 2 or inf, got ", norm_type);
  at::NoGradGuard no_grad;
  at::Tensor local = at::zeros({1}, at::TensorOptions(at::kDouble).device(units_.front()->flat->shard().device()));
  for (auto& u : units_) {
    at::Tensor g = u->flat->shard().grad();
    if (!g.defined()) continue;
    at::Tensor gd = g.to(at::kDouble);
    if (inf) {
      local = at::maximum(local, gd.abs().max().reshape({1}));
    } else {
      local += gd.pow(2).sum();
    }
  }
  // Shards are disjoint within the shard group and identical across replicas.
  // The communicator needs the compute device (CUDA for NCCL).
  at::Tensor on_comm = local.to(units_.front()->flat->device());
  shard_group_->AllReduce(on_comm, {inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum})->Wait();
  local = on_comm.cpu();
  const double total = inf ? local.item<double>() : std::sqrt(local.item<double>());
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (auto& u : units_) {
      at::Tensor g = u->flat->shard().grad();
      if (g.defined()) g.mul_(coef);
    }
  }
  return total;
}

ShardedModel::FullParamsScope::FullParamsScope(ShardedModel* m, bool writeback) : m_(m), writeback_(writeback) {
  ST_CHECK_ARG(!writeback || m->param_dtype_ == at::kFloat,
               "SummonFullParams(writeback=true) needs float32 parameters; param_dtype is ", m->param_dtype_);
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

// --- state dicts ---------------------------------------------------------------

std::map<std::string, at::Tensor> ShardedModel::GatherFullFromShards(const std::vector<at::Tensor>& per_unit) {
  ST_CHECK_ARG(per_unit.size() == units_.size(), "expected one tensor per unit (", units_.size(), "), got ",
               per_unit.size());
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < units_.size(); ++i) {
    const auto& flat = *units_[i]->flat;
    at::Tensor shard = per_unit[i].detach().to(flat.device(), at::kFloat).contiguous();
    ST_CHECK_ARG(shard.numel() == flat.shard_numel(), "unit '", flat.unit_name(), "': shard-shaped tensor has ",
                 shard.numel(), " elements, expected ", flat.shard_numel());
    at::Tensor full = at::empty({flat.padded_numel()}, shard.options());
    shard_group_->AllGather(shard, full)->Wait();
    auto tensors = flat.Unflatten(full);
    for (size_t k = 0; k < tensors.size(); ++k) out[flat.entries()[k].name] = tensors[k];
  }
  return out;
}

void ShardedModel::ForEachFullUnit(const std::function<at::Tensor(int unit)>& shard_of_unit, int root,
                                   const std::function<void(const std::string&, const at::Tensor&)>& fn) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < units_.size(); ++i) {
    const auto& flat = *units_[i]->flat;
    at::Tensor full;
    {
      at::Tensor given = shard_of_unit ? shard_of_unit(static_cast<int>(i)) : flat.shard();
      at::Tensor shard = given.detach().to(flat.device(), at::kFloat).contiguous();
      given = at::Tensor();
      ST_CHECK_ARG(shard.numel() == flat.shard_numel(), "unit '", flat.unit_name(), "': shard-shaped tensor has ",
                   shard.numel(), " elements, expected ", flat.shard_numel());
      full = at::empty({flat.padded_numel()}, shard.options());
      shard_group_->AllGather(shard, full)->Wait();
    }
    if (world_->rank() != root) continue;
    const auto views = flat.Views(full);
    for (size_t k = 0; k < views.size(); ++k) {
      fn(flat.entries()[k].name, views[k]);
      for (const auto& alias : flat.entries()[k].aliases) fn(alias, views[k]);
    }
  }
}

std::vector<at::Tensor> ShardedModel::ShardsFromFull(const std::map<std::string, at::Tensor>& full) const {
  std::vector<at::Tensor> out;
  for (auto& u : units_) {
    const auto& flat = *u->flat;
    std::vector<at::Tensor> ts;
    for (auto& e : flat.entries()) {
      auto it = full.find(e.name);
      ST_CHECK_ARG(it != full.end(), "missing tensor for parameter '", e.name, "'");
      ts.push_back(it->second.to(flat.device()));
    }
    out.push_back(flat.ShardOfFull(ts, at::kFloat));  // reads only this rank's slice of each tensor
  }
  return out;
}

std::map<std::string, at::Tensor> ShardedModel::FullStateDict(bool rank0_only, bool to_cpu) {
  std::vector<at::Tensor> shards;
  for (auto& u : units_) shards.push_back(u->flat->shard());
  auto params = GatherFullFromShards(shards);
  std::map<std::string, at::Tensor> out;
  if (rank0_only && world_->rank() != 0) return out;
  for (auto& [k, v] : params) out[k] = to_cpu ? v.cpu() : v;
  for (auto& u : units_) {
    for (const auto& e : u->flat->entries()) {
      for (const auto& alias : e.aliases) out[alias] = out.at(e.name);  // a tied weight under each of its names
    }
  }
  for (const auto& item : module_->named_buffers(true)) {
    at::Tensor b = item.value().detach();
    if (IsFloating(b)) b = b.to(at::kFloat);
    out[item.key()] = to_cpu ? b.cpu().clone() : b.clone();
  }
  return out;
}

void ShardedModel::LoadFullStateDict(const std::map<std::string, at::Tensor>& state) {
  std::ostringstream problems;
  std::set<std::string> expected;
  auto check = [&](const std::string& name, c10::IntArrayRef shape) {
    expected.insert(name);
    auto it = state.find(name);
    if (it == state.end()) {
      problems << "\n  missing: '" << name << "' " << shape;
    } else if (it->second.sizes() != shape) {
      problems << "\n  shape mismatch: '" << name << "' is " << it->second.sizes() << " in the state dict, "
               << shape << " in the model";
    } else if (!at::isFloatingType(it->second.scalar_type())) {
      problems << "\n  dtype mismatch: '" << name << "' is " << it->second.scalar_type()
               << ", expected a floating type";
    }
  };
  for (auto& u : units_) {
    for (auto& e : u->flat->entries()) {
      check(e.name, e.shape);
      // A tied weight's further names may be left out; when given they must
      // hold the same values as its first name.
      for (const auto& alias : e.aliases) {
        expected.insert(alias);
        auto a = state.find(alias), primary = state.find(e.name);
        if (a == state.end() || primary == state.end()) continue;
        if (a->second.sizes() != primary->second.sizes() || !at::equal(a->second, primary->second)) {
          problems << "\n  tied parameters differ: '" << alias << "' is the same tensor as '" << e.name
                   << "' in the model, but the state dict holds different values for them";
        }
      }
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  for (const auto& item : module_->named_buffers(true)) {
    expected.insert(item.key());
    auto it = state.find(item.key());
    if (it == state.end()) {
      problems << "\n  missing buffer: '" << item.key() << "'";
    } else if (it->second.sizes() != item.value().sizes()) {
      problems << "\n  shape mismatch: buffer '" << item.key() << "' is " << it->second.sizes()
               << " in the state dict, " << item.value().sizes() << " in the model";
    }
    buffers.emplace_back(item.key(), item.value());
  }
  for (auto& [k, v] : state) {
    if (!expected.count(k)) problems << "\n  unexpected: '" << k << "' " << v.sizes();
  }
  if (!problems.str().empty()) {
    ST_THROW(InvalidArgumentError, "state dict does not match the model (nothing was loaded):", problems.str());
  }
  at::NoGradGuard no_grad;
  auto shards = ShardsFromFull(state);
  for (size_t i = 0; i < units_.size(); ++i) units_[i]->flat->shard().detach().copy_(shards[i]);
  for (auto& [k, b] : buffers) b.copy_(state.at(k));
  // Gathered copies are stale now; aliased units (`full` is the shard) are current.
  for (auto& u : units_) Reshard(u.get());
}

ShardedStateDict ShardedModel::GetShardedStateDict() const {
  ShardedStateDict sd;
  sd.shard_rank = shard_group_->rank();
  sd.shard_world = shard_group_->size();
  sd.units = units();
  // No copies: on the CPU these are the live tensors (the writer streams them).
  for (auto& u : units_) sd.shards.push_back(u->flat->shard().detach().cpu());
  for (const auto& item : module_->named_buffers(true)) sd.buffers[item.key()] = item.value().detach().cpu();
  return sd;
}

void ShardedModel::LoadShardedStateDict(const std::vector<ShardedStateDict>& pieces) {
  ST_CHECK_ARG(!pieces.empty(), "LoadShardedStateDict: no pieces given");
  const int old_world = pieces.front().shard_world;
  std::vector<const ShardedStateDict*> by_rank(old_world, nullptr);
  for (const auto& p : pieces) {
    ST_CHECK_ARG(p.shard_world == old_world, "sharded checkpoint pieces disagree on the world size (", old_world,
                 " vs ", p.shard_world, ")");
    ST_CHECK_ARG(p.shard_rank >= 0 && p.shard_rank < old_world, "sharded checkpoint piece has rank ", p.shard_rank,
                 " outside [0, ", old_world, ")");
    if (!by_rank[p.shard_rank]) by_rank[p.shard_rank] = &p;  // HYBRID_SHARD replicas hold equal shards
  }
  for (int r = 0; r < old_world; ++r) {
    ST_CHECK_ARG(by_rank[r] != nullptr, "sharded checkpoint is missing the shard of rank ", r, " (of ", old_world,
                 ")");
  }
  const ShardedStateDict& first = pieces.front();
  const auto& meta = first.units;
  ST_CHECK_ARG(first.param_shapes.empty() || first.param_shapes.size() == meta.size(),
               "sharded checkpoint: parameter shapes for ", first.param_shapes.size(), " units, expected ", meta.size());
  // The model's layout (destination) and the saved one (source).
  std::map<std::string, int64_t> model_numel;
  std::vector<FlatUnitLayout> dst;
  for (auto& u : units_) {
    FlatUnitLayout l{u->name, {}, {}, u->flat->shard_numel()};
    for (auto& e : u->flat->entries()) {
      l.param_names.push_back(e.name);
      l.param_numels.push_back(e.numel);
      model_numel[e.name] = e.numel;
    }
    dst.push_back(std::move(l));
  }
  std::vector<FlatUnitLayout> src;
  std::ostringstream problems;
  for (size_t i = 0; i < meta.size(); ++i) {
    FlatUnitLayout l{meta[i].name, meta[i].param_names, {}, meta[i].shard_numel};
    for (size_t k = 0; k < meta[i].param_names.size(); ++k) {
      int64_t n = 0;
      if (!first.param_shapes.empty() && k < first.param_shapes[i].size()) {
        n = c10::multiply_integers(first.param_shapes[i][k]);
      } else {
        auto it = model_numel.find(meta[i].param_names[k]);
        n = it == model_numel.end() ? 0 : it->second;
      }
      l.param_numels.push_back(n);
    }
    if (l.numel() != meta[i].numel || meta[i].shard_numel * old_world < meta[i].numel) {
      problems << "\n  unit '" << meta[i].name << "' has " << meta[i].numel << " elements in " << old_world
               << " shards of " << meta[i].shard_numel << ", its parameters " << l.numel();
    }
    for (int r = 0; r < old_world; ++r) {
      if (by_rank[r]->shards.size() != meta.size() || by_rank[r]->shards[i].numel() != meta[i].shard_numel) {
        problems << "\n  the piece of shard rank " << r << " does not hold unit '" << meta[i].name << "' ("
                 << meta[i].shard_numel << " elements)";
      }
    }
    src.push_back(std::move(l));
  }
  std::vector<std::vector<ShardCopy>> plans;
  for (const auto& d : dst) {
    std::vector<std::string> unit_problems;
    plans.push_back(PlanShardCopies(src, old_world, d, shard_group_->rank(), &unit_problems));
    for (const auto& p : unit_problems) problems << "\n  " << p;
  }
  for (const auto& p : UnexpectedParameters(src, dst)) problems << "\n  " << p;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // (model's, saved)
  for (const auto& item : module_->named_buffers(true)) {
    auto it = first.buffers.find(item.key());
    if (it == first.buffers.end()) {
      problems << "\n  missing buffer: '" << item.key() << "'";
    } else if (it->second.sizes() != item.value().sizes()) {
      problems << "\n  shape mismatch: buffer '" << item.key() << "' is " << it->second.sizes()
               << " in the checkpoint, " << item.value().sizes() << " in the model";
    } else {
      buffers.emplace_back(item.value(), it->second);
    }
  }
  if (!problems.str().empty()) {
    ST_THROW(InvalidArgumentError, "sharded checkpoint does not match the model (nothing was loaded):",
             problems.str());
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < units_.size(); ++i) {
    at::Tensor shard = units_[i]->flat->shard().detach();
    shard.zero_();  // the padding tail (and nothing else stays unwritten)
    for (const auto& c : plans[i]) {
      const at::Tensor& from = by_rank[c.src_rank]->shards[c.src_unit];
      shard.narrow(0, c.dst_offset, c.len).copy_(from.reshape({-1}).narrow(0, c.src_offset, c.len));
    }
  }
  for (auto& [b, saved] : buffers) b.copy_(saved);
  // Gathered copies are stale now; aliased units (`full` is the shard) are current.
  for (auto& u : units_) Reshard(u.get());
}

}  // namespace shardtrain::sharding
