// GradScaler: dynamic loss scaling for "16-mixed" training (torch.amp.GradScaler;
// under FSDP, torch's ShardedGradScaler).
//
// float16 gradients lose small values to underflow. The loss is multiplied by
// `scale` before backward, so gradients stay representable, and the
// gradients are divided by it again before clipping and the optimizer step.
// A step whose gradients hold an inf or NaN (the scale was too large) is
// skipped and the scale shrinks by backoff_factor; after growth_interval
// steps in a row without one it grows by growth_factor.
//
//   at::Tensor scaled = scaler.Scale(loss);
//   strategy.Backward(scaled);
//   const bool found_inf = scaler.Unscale(strategy.parameters(),
//                                         [&](double v) { return strategy.ReduceMax(v); });
//   if (!found_inf) { clip; optimizer.step(); }
//   scaler.Update(found_inf);
//
// Under sharding every rank sees only its own gradient shards: the found-inf
// flag is combined over all ranks (Unscale's `reduce_max`), so every rank
// skips the same steps and the scale stays identical everywhere.
//
// The Trainer uses one with precision "16-mixed" (TrainerOptions::grad_scaler)
// and checkpoints state() under "grad_scaler", with the keys of
// torch.amp.GradScaler.state_dict().
#ifndef SHARDTRAIN_TRAINER_OPTIM_GRAD_SCALER_H_
#define SHARDTRAIN_TRAINER_OPTIM_GRAD_SCALER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace shardtrain::trainer {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;   // > 1
  double backoff_factor = 0.5;  // in (0, 1)
  int64_t growth_interval = 2000;
  bool enabled = true;  // false: "16-mixed" without loss scaling
};

// What a checkpoint holds (torch.amp.GradScaler.state_dict(): "scale",
// "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker").
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;  // steps without inf/NaN since the last change of the scale
};

class GradScaler {
 public:
  // Combines this rank's found-inf flag (0 or 1) over all ranks (max).
  using ReduceMax = std::function<double(double)>;

  // Throws InvalidArgumentError for options out of range.
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale, in float32 (a float16 loss is promoted first).
  at::Tensor Scale(const at::Tensor& loss) const;
  // Divides the gradients of `params` by the scale in place and returns
  // whether any of them, on any rank (through `reduce_max`; null: this rank
  // only), holds an inf or NaN. Call once per optimizer step, after the
  // backward that synchronizes gradients and before clipping.
  bool Unscale(const std::vector<at::Tensor>& params, const ReduceMax& reduce_max);
  // Adjusts the scale after a step: backoff when `found_inf`, growth after
  // growth_interval clean steps in a row (only to a finite float32 value).
  void Update(bool found_inf);

  double scale() const { return state_.scale; }
  int64_t growth_tracker() const { return state_.growth_tracker; }
  // Steps skipped (Update(true)) by this object.
  int64_t skipped_steps() const { return skipped_; }
  const GradScalerOptions& options() const { return options_; }

  GradScalerState state() const { return state_; }
  // Throws InvalidArgumentError (nothing changed) for a state out of range.
  void load_state(const GradScalerState& state);

 private:
  GradScalerOptions options_;
  GradScalerState state_;
  int64_t skipped_ = 0;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_OPTIM_GRAD_SCALER_H_
