#include "trainer/optim/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "base/errors.h"

namespace shardtrain::trainer {
namespace {

void CheckState(const GradScalerState& s, const char* what) {
  ST_CHECK_ARG(std::isfinite(s.scale) && s.scale > 0, what, ": scale must be finite and > 0, got ", s.scale);
  ST_CHECK_ARG(std::isfinite(s.growth_factor) && s.growth_factor > 1.0, what, ": growth_factor must be > 1, got ",
               s.growth_factor);
  ST_CHECK_ARG(s.backoff_factor > 0.0 && s.backoff_factor < 1.0, what, ": backoff_factor must be in (0, 1), got ",
               s.backoff_factor);
  ST_CHECK_ARG(s.growth_interval >= 1, what, ": growth_interval must be >= 1, got ", s.growth_interval);
  ST_CHECK_ARG(s.growth_tracker >= 0, what, ": growth tracker must be >= 0, got ", s.growth_tracker);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  state_.scale = options.init_scale;
  state_.growth_factor = options.growth_factor;
  state_.backoff_factor = options.backoff_factor;
  state_.growth_interval = options.growth_interval;
  state_.growth_tracker = 0;
  CheckState(state_, "GradScalerOptions");
}

at::Tensor GradScaler::Scale(const at::Tensor& loss) const {
  at::Tensor l = loss.scalar_type() == at::kFloat || loss.scalar_type() == at::kDouble ? loss : loss.to(at::kFloat);
  return l * state_.scale;
}

bool GradScaler::Unscale(const std::vector<at::Tensor>& params, const ReduceMax& reduce_max) {
  c10::AutoGradMode no_grad(false);
  // The fused kernel wants one device and one dtype per call (as torch's GradScaler groups them).
  std::map<std::tuple<int, int, int>, std::vector<at::Tensor>> groups;
  for (const auto& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    ST_CHECK_ARG(!g.is_sparse(), "GradScaler: sparse gradients are not supported");
    groups[{static_cast<int>(g.device().type()), static_cast<int>(g.device().index()),
            static_cast<int>(g.scalar_type())}]
        .push_back(g);
  }
  // 1/scale in float32, as torch computes it (scale.double().reciprocal().float()).
  const float inv = static_cast<float>(1.0 / state_.scale);
  bool local = false;
  std::map<std::pair<int, int>, at::Tensor> found;  // per device
  for (auto& [key, grads] : groups) {
    const at::Device dev = grads.front().device();
    auto& f = found[{std::get<0>(key), std::get<1>(key)}];
    if (!f.defined()) f = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(dev));
    at::Tensor inv_t = at::full({1}, inv, at::TensorOptions().dtype(at::kFloat).device(dev));
    at::_amp_foreach_non_finite_check_and_unscale_(grads, f, inv_t);
  }
  for (const auto& [dev, f] : found) local = local || f.item<float>() > 0;
  const double any = reduce_max ? reduce_max(local ? 1.0 : 0.0) : (local ? 1.0 : 0.0);
  return any > 0;
}

void GradScaler::Update(bool found_inf) {
  if (found_inf) {
    state_.scale *= state_.backoff_factor;
    state_.growth_tracker = 0;
    ++skipped_;
    return;
  }
  if (++state_.growth_tracker >= state_.growth_interval) {
    const double grown = state_.scale * state_.growth_factor;
    // torch keeps the scale in a float32 tensor and grows it only while that stays finite.
    if (std::isfinite(static_cast<float>(grown))) state_.scale = grown;
    state_.growth_tracker = 0;
  }
}

void GradScaler::load_state(const GradScalerState& state) {
  CheckState(state, "GradScaler state");
  state_ = state;
}

}  // namespace shardtrain::trainer
