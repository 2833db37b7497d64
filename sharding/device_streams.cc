#include "sharding/internal/device_streams.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace shardtrain::sharding::internal {
namespace {

const c10::impl::DeviceGuardImplInterface& Impl(c10::Device device) {
  return *c10::impl::getDeviceGuardImpl(device.type());
}

// `side` on `device` (taken from the pool on first use or a device change).
const c10::Stream& SideStream(std::optional<c10::Stream>& side, c10::Device device, bool high_priority) {
  if (!side || side->device() != device) side = Impl(device).getStreamFromGlobalPool(device, high_priority);
  return *side;
}

// `side` waits (on the device) for what the caller's current stream on its device has queued so far.
void WaitForCurrentStream(const c10::Stream& side) {
  c10::Event now(side.device_type());
  now.record(Impl(side.device()).getStream(side.device()));
  now.block(side);
}

}  // namespace

void GatherOrder::Mark(c10::Device device) {
  if (!HasStreams(device)) return;
  mark_.emplace(device.type());
  mark_->record(Impl(device).getStream(device));
}

void GatherOrder::Forget() { mark_.reset(); }

void GatherOrder::Issue(c10::Device device, const std::function<void()>& issue) {
  if (!HasStreams(device)) {
    issue();
    return;
  }
  const c10::Stream& side = SideStream(side_, device, /*high_priority=*/true);
  if (mark_ && mark_->device_index() == device.index()) {
    mark_->block(side);
  } else {  // outside an iteration: after everything queued so far, as a collective from the caller's stream
    WaitForCurrentStream(side);
  }
  c10::StreamGuard on_side(side);
  issue();
}

void GatherOrder::RecordComputeUse(const at::Tensor& gathered) {
  if (!side_ || !HasStreams(gathered.device()) || gathered.storage().nbytes() == 0) return;
  const c10::Device device = gathered.device();
  Impl(device).recordDataPtrOnStream(gathered.storage().data_ptr(), Impl(device).getStream(device));
}

at::Tensor GradOffload::Start(const at::Tensor& reduced) {
  const c10::Device device = reduced.device();
  const c10::Stream& side = SideStream(side_, device, /*high_priority=*/false);
  WaitForCurrentStream(side);  // its reduce-scatter
  at::Tensor host = at::empty(reduced.sizes(), reduced.options().device(c10::kCPU).pinned_memory(true));
  {
    c10::StreamGuard on_side(side);
    host.copy_(reduced, /*non_blocking=*/true);
  }
  Impl(device).recordDataPtrOnStream(reduced.storage().data_ptr(), side);  // not reused before the copy read it
  last_.emplace(device.type());
  last_->record(side);
  return host;
}

void GradOffload::Wait() {
  if (last_) last_->synchronize();
  last_.reset();
}

}  // namespace shardtrain::sharding::internal
