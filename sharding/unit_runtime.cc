// A unit's runtime in forward: gathering its full parameters (all-gather of
// the shards), freeing them again, prefetching the next unit, and the hooks
// the wrap points call around each unit's forward.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <vector>

#include "base/logging.h"
#include "sharding/flat_parameter.h"
#include "sharding/internal/device_streams.h"
#include "sharding/internal/sharded_unit.h"
#include "sharding/sharded_model.h"

namespace shardtrain::sharding {

using internal::Stopwatch;

// --- gathering ---------------------------------------------------------------

void ShardedModel::Unshard(ShardedUnit* u) {
  if (u->state != ShardedUnit::State::kSharded) return;
  at::Tensor shard = u->flat->shard().detach();
  if (shard_group_->size() == 1 && !options_.force_collectives) {
    AllocateStorage(u->full);
    u->full.copy_(shard, /*non_blocking=*/true);
    u->state = ShardedUnit::State::kGathered;
    return;
  }
  // On a CUDA device the buffer, the input and the collective are queued on
  // a side stream that waits only for the iteration's start, so this gather
  // overlaps the forward queued before it (sharding/internal/device_streams.h).
  gather_order_->Issue(u->full.device(), [&] {
    AllocateStorage(u->full);
    // From an offloaded (CPU) shard this is an asynchronous host-to-device
    // copy, which the communicator's stream waits for.
    u->gather_input = shard.to(u->full.device(), param_dtype_, /*non_blocking=*/true);
    Stopwatch sw(&comm_times_.gather_issue_s);
    u->gather_work = shard_group_->AllGather(u->gather_input, u->full);
  });
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
  gather_order_->RecordComputeUse(u->full);  // allocated on the gather stream, used by compute
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
  gather_order_->Mark(root_->full.device());  // the shards stay as they are until the iteration ends
  Unshard(root_);
  WaitUnshard(root_);
}

void ShardedModel::EndForward(const std::vector<at::Tensor>& outputs) {
  order_recorded_ = true;
  if (!at::GradMode::is_enabled()) {
    for (auto& u : units_) Reshard(u.get());
    gather_order_->Forget();
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

}  // namespace shardtrain::sharding
