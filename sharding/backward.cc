// Backward of a ShardedModel: collecting each unit's gradients into its flat
// gradient buffer, reduce-scattering them in one order on every rank while
// backward runs, all-reducing across replicas (HYBRID_SHARD, NO_SHARD), and
// handing the reduced shard gradients to the optimizer's tensors.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "base/errors.h"
#include "sharding/flat_parameter.h"
#include "sharding/internal/device_streams.h"
#include "sharding/internal/sharded_unit.h"
#include "sharding/sharded_model.h"

namespace shardtrain::sharding {

using internal::AliasRange;
using internal::Stopwatch;

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
  if (!u->flat_grad.defined() && !no_sync_ && reduce_dtype_ == param_dtype_ && shard_group_->ReadsPiecesInPlace()) {
    // Each gradient stays where AccumulateGrad puts it (LaunchReduce).
    u->grads_in_place = true;
    u->grad_written.assign(entries.size(), false);
    for (const auto& e : entries) {
      if (e.requires_grad) e.param.mutable_grad() = at::Tensor();
    }
  } else if (!u->flat_grad.defined()) {
    u->grads_in_place = false;
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
  PollReduces();
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
  if (u->grads_in_place) {
    if (g.defined() && !g.is_contiguous()) g = g.contiguous();
    u->grad_written[entry] = g.defined();
    if (--u->grads_pending == 0) {
      u->ready = true;
      LaunchReadyInOrder();
    }
    return;
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
  if (u->grads_in_place && !no_sync_) {
    LaunchReducePieces(u);
    return;
  }
  if (u->grads_in_place) MoveGradsToFlat(u);  // no_sync began after this unit was armed
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
  u->reduce_in = in;
  IssueReduce(u, [&](const comm::ReduceOptions& ro) { return shard_group_->ReduceScatter(in, u->reduce_out, ro); });
}

void ShardedModel::IssueReduce(ShardedUnit* u,
                               const std::function<comm::WorkPtr(const comm::ReduceOptions&)>& reduce_scatter) {
  comm::ReduceOptions ro;
  ro.op = comm::ReduceOp::kSum;
  ro.pre_divide = pre_divide_;
  ro.post_divide = post_divide_;
  {
    Stopwatch sw(&comm_times_.reduce_issue_s);
    u->reduce_work = reduce_scatter(ro);
  }
  reducing_.push_back(u);
  FinishReduces(kMaxReducesInFlight);
}

// The unit's gradients as the pieces of its padded flat gradient, read where
// autograd left them: each parameter's .grad, and zeros for frozen
// parameters, parameters without a gradient this backward and the padding.
void ShardedModel::LaunchReducePieces(ShardedUnit* u) {
  const auto& entries = u->flat->entries();
  const at::TensorOptions options = u->full.options().dtype(param_dtype_);
  std::vector<at::Tensor> pieces;
  int64_t zeros = 0;  // zeros owed before the next gradient
  auto add_zeros = [&] {
    if (zeros > 0) pieces.push_back(at::zeros({zeros}, options));
    zeros = 0;
  };
  for (size_t k = 0; k < entries.size(); ++k) {
    if (entries[k].requires_grad && u->grad_written[k]) {
      add_zeros();
      pieces.push_back(entries[k].param.grad().reshape(-1));
    } else {
      zeros += entries[k].numel;
    }
    if (entries[k].requires_grad) entries[k].param.mutable_grad() = at::Tensor();
  }
  zeros += u->flat->padded_numel() - u->flat->numel();
  add_zeros();
  u->grad_written.clear();
  u->grads_in_place = false;
  u->reduce_out = at::empty({u->flat->shard_numel()}, options);
  u->reduce_pieces = std::move(pieces);
  IssueReduce(u, [&](const comm::ReduceOptions& ro) {
    return shard_group_->ReduceScatterPieces(u->reduce_pieces, u->reduce_out, ro);
  });
}

// Copies gradients kept in place into a flat gradient buffer, as if they had
// been collected there (for a no_sync accumulation that began after the unit
// was armed).
void ShardedModel::MoveGradsToFlat(ShardedUnit* u) {
  const auto& entries = u->flat->entries();
  u->flat_grad = at::zeros({u->flat->padded_numel()}, u->full.options().dtype(param_dtype_));
  u->grad_views = u->flat->Views(u->flat_grad);
  for (size_t k = 0; k < entries.size(); ++k) {
    if (!entries[k].requires_grad || !u->grad_written[k]) continue;
    u->grad_views[k].copy_(entries[k].param.grad());
    entries[k].param.mutable_grad() = u->grad_views[k];
  }
  u->grads_in_place = false;
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
    u->reduce_pieces.clear();
    // Offloaded shards on a GPU: the gradient starts for the host now, overlapping the
    // rest of backward (HYBRID_SHARD's replicate all-reduce needs it on the device first).
    if (options_.offload_params && !replicate_group_ && u->reduce_out.is_cuda()) {
      u->reduce_host = grad_offload_->Start(u->reduce_out);
    }
    reduced_.push_back(u);
  }
  if (!replicate_group_) return;
  const size_t launched = reduced_.size() + reducing_.size();
  IssueReplicatesDue(root_->full.is_cuda() ? (launched > keep ? launched - keep : 0) : reduced_.size());
}

// Between launches (from the gradient hooks), on the CPU: completes the
// reduce-scatters that have finished, so that their replicate all-reduces
// start now rather than at the next launch. Polls only; never waits.
void ShardedModel::PollReduces() {
  if (replicate_group_ && !reducing_.empty() && !root_->full.is_cuda() &&
      reducing_.front()->reduce_work->IsCompleted()) {
    FinishReduces(kMaxReducesInFlight);
  }
}

// HYBRID_SHARD overlapped: a unit's all-reduce across replicas starts as soon
// as its reduce-scatter is complete, while backward goes on (as PyTorch's HSDP
// does), instead of all of them after backward. On a CUDA device which units
// are issued depends only on how many reduce-scatters were launched (`due`:
// those no longer allowed in flight), never on which happened to finish early,
// so every rank issues its shard-group and replicate-group collectives in the
// same interleaving (a NCCL requirement across communicators). On the CPU each
// Gloo communicator runs its collectives in issue order on threads of its own,
// so every completed reduce-scatter's all-reduce is due at once (the replicate
// group still sees the same units in the same order on every rank).
void ShardedModel::IssueReplicatesDue(size_t due) {
  for (; replicated_ < due && replicated_ < reduced_.size(); ++replicated_) {
    ShardedUnit* u = reduced_[replicated_];
    if (!u->reduce_out.defined()) continue;
    Stopwatch sw(&comm_times_.replicate_issue_s);
    u->replicate_work = replicate_group_->AllReduce(u->reduce_out);
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
  FinishReduces(0);  // issues the replicate all-reduces not issued yet
  for (auto* u : reduced_) {
    if (!u->replicate_work) continue;
    Stopwatch sw(&comm_times_.replicate_wait_s);
    u->replicate_work->Wait();
    u->replicate_work.reset();
  }
  reduced_.clear();
  replicated_ = 0;
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
  grad_offload_->Wait();
  for (auto* u : reduce_order_) {
    if (!u->reduce_out.defined()) continue;
    // Back to the CPU when offloaded (on a GPU, copied during backward by GradOffload).
    at::Tensor g = u->reduce_host.defined() ? u->reduce_host.to(at::kFloat)
                                            : u->reduce_out.to(u->flat->shard().device(), at::kFloat);
    u->reduce_host = at::Tensor();
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
  gather_order_->Forget();  // the optimizer step writes the shards next
  // Under no_sync nothing was reduced: the shard gradient may be last step's,
  // which must not reappear as the parameters' gradients.
  if (!no_sync_) RealiasOrigParamGrads();
}

void ShardedModel::ResetIteration() {
  for (auto& u : units_) {
    for (comm::WorkPtr* w : {&u->reduce_work, &u->replicate_work}) {
      if (*w) {
        try {
          (*w)->Wait();
        } catch (...) {
        }
      }
      w->reset();
    }
    u->reduce_in = u->reduce_out = u->reduce_host = at::Tensor();
    u->reduce_pieces.clear();
    u->grads_in_place = false;
    u->grads_armed = u->pre_backward_done = u->ready = u->launched = false;
    Reshard(u.get());
  }
  reducing_.clear();
  reduced_.clear();
  replicated_ = 0;
  next_launch_ = 0;
  callback_queued_ = false;
  gather_order_->Forget();
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

}  // namespace shardtrain::sharding
