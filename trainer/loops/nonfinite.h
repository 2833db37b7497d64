// Non-finite losses and gradients (TrainerOptions::nonfinite): what a step
// does when its loss or a gradient is NaN or infinite on any rank.
//
//   "off"    (default) nothing is checked; a NaN trains on (as Lightning
//            without detect_anomaly).
//   "error"  every rank stops at that step with NonfiniteError naming the
//            global step and what was found first on this rank: the loss,
//            or the first parameter (in the strategy's order: for sharded
//            strategies a unit's flat shard) with a non-finite gradient.
//            Ranks that found nothing say how many ranks did.
//   "skip"   the optimizer step is skipped on every rank (global step and
//            LR schedule advance, as for a 16-mixed overflow); each skip is
//            counted (Trainer::skipped_nonfinite_steps) and logged on rank 0.
//
// The decision is shared without a collective of its own: each rank's flag
// rides in the overflow slot of the step's one all-reduce (the 16-mixed
// GradScaler's overflow counts 1 per rank in that slot; a non-finite value
// counts kFlag per rank, so the sum tells both apart and how many ranks
// found one). With "16-mixed" the scaler owns gradient overflows (they are
// expected while it searches for its scale), so only the loss is checked.
#ifndef SHARDTRAIN_TRAINER_LOOPS_NONFINITE_H_
#define SHARDTRAIN_TRAINER_LOOPS_NONFINITE_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/errors.h"

namespace shardtrain::trainer {

// Thrown on every rank by nonfinite = "error".
class NonfiniteError : public Error {
 public:
  using Error::Error;
};

// TrainerOptions::nonfinite's values: off, error, skip.
const std::vector<std::string>& NonfiniteModes();

class NonfiniteCheck {
 public:
  // What each rank adds to the overflow slot when it found a non-finite value
  // (larger than any world size's sum of overflow flags).
  static constexpr double kFlag = 1 << 20;

  // `mode`: "off", "error" or "skip" (InvalidArgumentError otherwise).
  // `check_gradients`: false under 16-mixed (the scaler's business).
  explicit NonfiniteCheck(const std::string& mode = "off", bool check_gradients = true);

  bool enabled() const { return mode_ != Mode::kOff; }

  // This rank's contribution to the slot for this step: 0, or kFlag when the
  // loss (this rank's micro-batch mean) or a gradient is not finite. Remembers
  // what it found for the error message.
  double LocalFlag(double loss, const std::vector<std::pair<std::string, at::Tensor>>& named_parameters);

  // After the all-reduce (`slot_sum`: the slot summed over the ranks):
  // whether the optimizer step must be skipped for a non-finite value.
  // Throws NonfiniteError with "error"; counts and logs with "skip".
  bool Decide(double slot_sum, int64_t global_step, int rank);

  int64_t skipped() const { return skipped_; }

 private:
  enum class Mode { kOff, kError, kSkip };
  Mode mode_ = Mode::kOff;
  bool check_gradients_ = true;
  std::string found_;  // this rank's finding of the current step ("" if none)
  int64_t skipped_ = 0;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_LOOPS_NONFINITE_H_
