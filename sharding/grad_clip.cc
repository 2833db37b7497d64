#include "sharding/grad_clip.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <optional>

#include "base/errors.h"
#include "comm/host_collectives.h"

namespace shardtrain::sharding {

at::Tensor ClipGradNorm(const std::vector<at::Tensor>& grads, double max_norm, double norm_type,
                        const comm::CommunicatorPtr& group) {
  ST_CHECK_ARG(max_norm > 0, "ClipGradNorm: max_norm must be > 0, got ", max_norm);
  const bool inf = std::isinf(norm_type);
  ST_CHECK_ARG(inf || norm_type == 2.0, "ClipGradNorm: norm_type must be 2 or inf, got ", norm_type);
  at::NoGradGuard no_grad;
  at::Tensor acc;  // sum of squares or max, float64, on the gradients' device
  std::optional<c10::Device> grad_device;  // where the gradients are scaled: the first one's device
  for (const auto& grad : grads) {
    if (!grad.defined()) continue;
    if (!grad_device) grad_device = grad.device();
    at::Tensor g = grad.to(at::kDouble);
    at::Tensor part = inf ? g.abs().max() : g.pow(2).sum();
    if (!acc.defined()) {
      acc = part;
    } else {
      acc = inf ? at::maximum(acc, part.to(acc.device())) : acc + part.to(acc.device());
    }
  }
  if (group) {
    // The collective runs on the communicator's device (CUDA for NCCL, even
    // when offloaded gradients live on the host).
    const c10::Device device = comm::CollectiveDevice(*group);
    acc = acc.defined() ? acc.reshape({1}).to(device) : at::zeros({1}, at::TensorOptions(at::kDouble).device(device));
    if (group->size() > 1) group->AllReduce(acc, {inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum})->Wait();
  }
  if (!acc.defined()) return at::zeros({}, at::kDouble);
  // Back where the gradients are (offloaded ones: the host reads it once, as on the CPU).
  // A rank of the group with no gradient keeps it where the collective left it.
  acc = acc.reshape({});
  if (grad_device) acc = acc.to(*grad_device);
  if (acc.device().is_cpu()) {
    const double v = acc.item<double>();
    const double total = inf ? v : std::sqrt(v);
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0) {
      for (const auto& g : grads) {
        if (g.defined()) g.mul_(coef);
      }
    }
    return at::scalar_tensor(total, at::kDouble);
  }
  const at::Tensor total = inf ? acc : acc.sqrt();
  const at::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
  for (const auto& g : grads) {
    if (g.defined()) g.mul_(coef);
  }
  return total;
}

}  // namespace shardtrain::sharding
