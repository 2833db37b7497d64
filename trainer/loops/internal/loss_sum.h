// Internal to //trainer: the micro-batch losses of one optimizer step, summed
// in double where they live and read on the host once per step.
//
// On a CUDA device the sum stays on the device. After each micro-batch's
// forward, Add() starts an asynchronous copy of the running sum into
// page-locked host memory and records an event behind it, both on the
// current stream and so before the backward that follows; Read() waits for
// that event only. No micro-batch waits for the device, and the step's one
// read waits for the last forward, never for a backward. On the CPU it is a
// plain double (the same additions, in the same order, as on the device).
#ifndef SHARDTRAIN_TRAINER_LOOPS_INTERNAL_LOSS_SUM_H_
#define SHARDTRAIN_TRAINER_LOOPS_INTERNAL_LOSS_SUM_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <optional>

namespace shardtrain::trainer::internal {

class LossSum {
 public:
  // Adds a micro-batch's loss (a scalar tensor on any device; not read here).
  void Add(const at::Tensor& loss);
  // The sum of the losses added since Reset() (0 when none).
  double Read();
  // How many losses were added since Reset().
  int64_t count() const { return count_; }
  void Reset();

 private:
  double host_sum_ = 0;        // losses on the CPU
  at::Tensor device_sum_;      // losses on a device: their running sum there
  at::Tensor pinned_;          // its last copy, page-locked
  std::optional<c10::Event> copied_;  // recorded behind that copy
  int64_t count_ = 0;
};

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_LOOPS_INTERNAL_LOSS_SUM_H_
