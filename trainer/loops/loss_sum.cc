#include "trainer/loops/internal/loss_sum.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "base/errors.h"

namespace shardtrain::trainer::internal {

void LossSum::Add(const at::Tensor& loss) {
  ST_CHECK_ARG(loss.defined() && loss.numel() == 1, "training_step must return a scalar loss; got ",
               loss.defined() ? "a tensor of " + std::to_string(loss.numel()) + " elements" : "an undefined tensor");
  ++count_;
  const at::Tensor l = loss.detach().reshape({});
  if (l.device().is_cpu()) {
    host_sum_ += l.to(at::kDouble).item<double>();
    return;
  }
  const at::Tensor as_double = l.to(at::kDouble);
  device_sum_ = device_sum_.defined() ? device_sum_ + as_double : as_double;
  if (!pinned_.defined()) pinned_ = at::empty({}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
  pinned_.copy_(device_sum_, /*non_blocking=*/true);
  const c10::DeviceType type = l.device().type();
  if (!copied_ || copied_->device_type() != type) copied_.emplace(type);
  copied_->record(c10::impl::getDeviceGuardImpl(type)->getStream(l.device()));
}

double LossSum::Read() {
  double sum = host_sum_;
  if (device_sum_.defined()) {
    copied_->synchronize();
    sum += pinned_.item<double>();
  }
  return sum;
}

void LossSum::Reset() {
  host_sum_ = 0;
  device_sum_ = at::Tensor();
  count_ = 0;
}

}  // namespace shardtrain::trainer::internal
