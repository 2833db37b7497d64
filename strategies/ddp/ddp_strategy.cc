#include "strategies/ddp/ddp_strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include <set>

#include "base/errors.h"
#include "base/names.h"
#include "sharding/grad_ready_hook.h"

namespace shardtrain::strategies {

const OptionTable<DdpOptions>& DdpOptions::Table() {
  using O = DdpOptions;
  static const OptionTable<O> table({
      OptionDouble("bucket_cap_mb", &O::bucket_cap_mb,
                   "gradients are all-reduced in buckets of at most this many MiB (default 25; > 0)"),
      OptionBool("broadcast_buffers", &O::broadcast_buffers,
                 "broadcast rank 0's buffers before every forward, as PyTorch DDP (default true)"),
      OptionBool("find_unused_parameters", &O::find_unused_parameters,
                 "true: a trainable parameter that gets no gradient in a syncing backward contributes zeros; "
                 "false (default, as PyTorch DDP): such a parameter is an error naming it"),
  });
  return table;
}

DdpOptions DdpOptions::FromStrings(const StrategyOptions& in) { return Table().Parse(in, "ddp"); }

DdpStrategy::DdpStrategy(DdpOptions options) : options_(options) {
  ST_CHECK_ARG(options_.bucket_cap_mb > 0, "strategy 'ddp': bucket_cap_mb must be > 0, got ", options_.bucket_cap_mb);
}

void DdpStrategy::WrapModel(std::shared_ptr<torch::nn::Module> module) {
  TakeModule(std::move(module));
  if (world_size() > 1) {
    at::NoGradGuard no_grad;
    std::vector<comm::WorkPtr> works;
    for (auto& p : module_->parameters()) works.push_back(world_->Broadcast(p.detach(), 0));
    for (auto& b : module_->buffers()) works.push_back(world_->Broadcast(b, 0));
    for (auto& w : works) w->Wait();
  }
  BuildBuckets();
}

at::Tensor DdpStrategy::Forward(const std::function<at::Tensor()>& fn) {
  CheckWrapped("Forward");
  if (options_.broadcast_buffers && world_size() > 1 && at::GradMode::is_enabled()) {
    at::NoGradGuard no_grad;
    std::vector<comm::WorkPtr> works;
    for (auto& b : module_->buffers()) works.push_back(world_->Broadcast(b, 0));
    for (auto& w : works) w->Wait();
  }
  return ForwardWithPrecision(fn);
}

// One all-reduce's worth of gradients: a flat buffer and the parameters whose
// .grad alias it.
struct DdpStrategy::Bucket {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> views;  // views[i] is params[i]'s gradient inside `flat` (an alias, not an autograd view)
  at::Tensor flat;
  // The parameters' AccumulateGrad nodes, kept alive: a parameter holds its
  // accumulator weakly, and a new one would not carry the hook.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  size_t pending = 0;  // gradients not yet accumulated in this backward
  std::vector<char> ready;  // ready[i]: params[i] got its gradient in this syncing backward
  comm::WorkPtr work;
};

DdpStrategy::~DdpStrategy() { alive_.reset(); }

void DdpStrategy::BuildBuckets() {
  std::vector<at::Tensor> params;
  for (auto& p : UniqueParameters(*module_)) {
    if (p.requires_grad()) params.push_back(p);
  }
  // Reverse registration order: roughly the order gradients become ready.
  const int64_t cap = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
  int64_t bytes = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const int64_t b = it->numel() * it->element_size();
    if (buckets_.empty() || (bytes + b > cap && !buckets_.back()->params.empty()) ||
        buckets_.back()->params.front().scalar_type() != it->scalar_type() ||
        buckets_.back()->params.front().device() != it->device()) {
      buckets_.push_back(std::make_unique<Bucket>());
      bytes = 0;
    }
    buckets_.back()->params.push_back(*it);
    bytes += b;
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = *buckets_[bi];
    int64_t numel = 0;
    for (const auto& p : b.params) numel += p.numel();
    b.flat = at::zeros({numel}, b.params.front().options().requires_grad(false));
    int64_t off = 0;
    for (size_t i = 0; i < b.params.size(); ++i) {
      const at::Tensor& p = b.params[i];
      // Aliases the buffer without being an autograd view, so optimizers may
      // detach_() and reset .grad (zero_grad) as with any gradient.
      at::Tensor view = at::empty({0}, b.flat.options());
      view.set_(b.flat.storage(), b.flat.storage_offset() + off, p.sizes(), {});  // contiguous
      b.views.push_back(view);
      off += p.numel();
      b.accumulators.push_back(sharding::OnGradientReady(p, alive_, [this, bi, i] { OnGradReady(bi, i); }));
    }
  }
}

// Makes every trainable parameter's .grad its view in the bucket buffer,
// keeping what was accumulated so far (gradient accumulation) and zeroing
// what the optimizer set to none. A bucket whose gradients are all none
// (the optimizer's zero_grad) is left so: each gradient AccumulateGrad
// makes is copied into its view when it is ready (OnGradReady), which moves
// half the bytes of zeroing the buffer and adding into it; views that got no
// gradient are zeroed when the bucket is launched (FillBucket).
void DdpStrategy::ArmGradViews() {
  at::NoGradGuard no_grad;
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    bool all_none = true;
    for (const auto& p : b.params) all_none = all_none && !p.grad().defined();
    if (!all_none) FillBucket(b);
  }
}

// Before a bucket is reduced: every gradient is its view, parameters that
// got none this backward with zeros there (another rank may have one).
void DdpStrategy::FillBucket(Bucket& b) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < b.params.size(); ++i) {
    at::Tensor& g = b.params[i].mutable_grad();
    if (g.defined() && g.is_same(b.views[i])) continue;
    if (g.defined()) b.views[i].copy_(g);
    else b.views[i].zero_();
    g = b.views[i];
  }
}

void DdpStrategy::OnGradReady(size_t bucket, size_t index) {
  Bucket& b = *buckets_[bucket];
  at::Tensor& g = b.params[index].mutable_grad();
  if (g.defined() && !g.is_same(b.views[index])) {
    // AccumulateGrad replaced .grad (e.g. a layout change): fold it back in.
    at::NoGradGuard no_grad;
    b.views[index].copy_(g);
    g = b.views[index];
  }
  if (!counting_ || b.ready[index]) return;
  b.ready[index] = 1;
  if (--b.pending == 0 && syncing_) LaunchInOrder(/*flush=*/false);
}

// Launches complete buckets in index order; with `flush`, every bucket not
// yet launched (parameters without a gradient this backward keep their values).
void DdpStrategy::LaunchInOrder(bool flush) {
  while (next_launch_ < buckets_.size() && (flush || buckets_[next_launch_]->pending == 0)) {
    Bucket& b = *buckets_[next_launch_++];
    b.pending = 0;
    FillBucket(b);
    b.work = world_->AllReduce(b.flat, {comm::ReduceOp::kAvg});
    if (in_backward_) ++launched_during_backward_;
  }
}

void DdpStrategy::Backward(const at::Tensor& loss, bool sync_gradients) {
  CheckWrapped("Backward");
  ArmGradViews();
  syncing_ = sync_gradients && world_size() > 1;
  counting_ = sync_gradients;
  if (counting_) {
    for (auto& b : buckets_) {
      b->pending = b->params.size();
      b->ready.assign(b->params.size(), 0);
      b->work.reset();
    }
    next_launch_ = 0;
    launched_during_backward_ = 0;
  }
  in_backward_ = true;
  try {
    torch::autograd::backward({loss});
  } catch (...) {
    in_backward_ = false;
    syncing_ = counting_ = false;
    throw;
  }
  in_backward_ = false;
  // Every bucket is reduced even when some gradient is missing, so that all
  // ranks issue the same collectives before any of them reports it.
  const std::vector<std::string> unused =
      counting_ && !options_.find_unused_parameters ? Unused() : std::vector<std::string>{};
  counting_ = false;
  if (!syncing_) {
    if (!unused.empty()) ThrowUnused(unused);
    return;
  }
  syncing_ = false;
  LaunchInOrder(/*flush=*/true);
  for (auto& b : buckets_) {
    b->work->Wait();
    b->work.reset();
  }
  if (!unused.empty()) ThrowUnused(unused);
}

void DdpStrategy::ThrowUnused(const std::vector<std::string>& unused) {
  ST_THROW(InvalidArgumentError, "ddp: these trainable parameters got no gradient in this backward: ",
           JoinNames(unused, 8),
           ". Set the strategy option find_unused_parameters=true when parts of the model take no part in some "
           "steps (their gradients then count as zeros), or freeze them (requires_grad false)");
}

// Names of the trainable parameters that got no gradient in this syncing
// backward (a tied weight under its first name).
std::vector<std::string> DdpStrategy::Unused() const {
  std::set<const void*> missing;
  for (const auto& b : buckets_) {
    if (b->pending == 0) continue;
    for (size_t i = 0; i < b->params.size(); ++i) {
      if (!b->ready[i]) missing.insert(b->params[i].unsafeGetTensorImpl());
    }
  }
  std::vector<std::string> names;
  if (missing.empty()) return names;
  for (const auto& [name, p] : UniqueNamedParameters(*module_)) {
    if (missing.count(p.unsafeGetTensorImpl())) names.push_back(name);
  }
  return names;
}

namespace {
const bool kRegistered = RegisterStrategy(
    "ddp", DdpOptions::Table().Docs(),
    [](const StrategyOptions& o) { return std::make_shared<DdpStrategy>(DdpOptions::FromStrings(o)); },
    "replicated data parallel: gradients all-reduced in buckets after backward");
}  // namespace

}  // namespace shardtrain::strategies
