#include "sharding/internal/device_streams.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace shardtrain::sharding::internal {
namespace {

const c10::impl::DeviceGuardImplInterface& Impl(c10::Device device) {
  return *c10::impl::getDeviceGuardImpl(device.type());
}

}  // namespace

void GatherOrder::Mark(c10::Device device) {
  if (!HasStreams(device)) return;
  mark_.emplace(device.type());
  mark_->record(Impl(device).getStream(device));
  marked_ = true;
}

void GatherOrder::Forget() { marked_ = false; }

void GatherOrder::Issue(c10::Device device, const std::function<void()>& issue) {
  if (!HasStreams(device)) {
    issue();
    return;
  }
  const c10::impl::DeviceGuardImplInterface& impl = Impl(device);
  if (!side_ || side_->device() != device) side_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  if (marked_ && mark_->device_index() == device.index()) {
    mark_->block(*side_);
  } else {  // outside an iteration: after everything queued so far, as a collective from the caller's stream
    c10::Event now(device.type());
    now.record(impl.getStream(device));
    now.block(*side_);
  }
  c10::StreamGuard on_side(*side_);
  issue();
}

void GatherOrder::RecordComputeUse(const at::Tensor& gathered) {
  if (!side_ || !HasStreams(gathered.device()) || gathered.storage().nbytes() == 0) return;
  const c10::Device device = gathered.device();
  Impl(device).recordDataPtrOnStream(gathered.storage().data_ptr(), Impl(device).getStream(device));
}

at::Tensor GradOffload::Start(const at::Tensor& reduced) {
  const c10::Device device = reduced.device();
  const c10::impl::DeviceGuardImplInterface& impl = Impl(device);
  if (!side_ || side_->device() != device) side_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  c10::Event ready(device.type());
  ready.record(impl.getStream(device));
  ready.block(*side_);
  at::Tensor host = at::empty(reduced.sizes(), reduced.options().device(c10::kCPU).pinned_memory(true));
  {
    c10::StreamGuard on_side(*side_);
    host.copy_(reduced, /*non_blocking=*/true);
  }
  impl.recordDataPtrOnStream(reduced.storage().data_ptr(), *side_);  // not reused before the copy read it
  last_.emplace(device.type());
  last_->record(*side_);
  return host;
}

void GradOffload::Wait() {
  if (last_) last_->synchronize();
  last_.reset();
}

}  // namespace shardtrain::sharding::internal
