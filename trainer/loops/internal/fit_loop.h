// Internal to //trainer: Trainer::Fit's loop (Lightning's fit loop): the
// sanity check, epochs, the training step, the step's one collective, the
// optimizer step, the end of a step, of an epoch and of the fit. Owned by the
// Trainer and working on its state (a friend); one per Trainer.
#ifndef SHARDTRAIN_TRAINER_LOOPS_INTERNAL_FIT_LOOP_H_
#define SHARDTRAIN_TRAINER_LOOPS_INTERNAL_FIT_LOOP_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace shardtrain::trainer {

class Trainer;
class TrainingModule;
class Dataset;
struct Batch;

namespace internal {

class FitLoop {
 public:
  explicit FitLoop(Trainer& trainer) : t_(trainer) {}
  FitLoop(const FitLoop&) = delete;
  FitLoop& operator=(const FitLoop&) = delete;

  // The body of Trainer::Fit (which adds the on_exception hooks).
  void Run(TrainingModule& module, const Dataset& train, const Dataset* val, const std::string& ckpt_path);

 private:
  struct State;  // what one Fit carries from step to step (fit_loop.cc)

  // num_sanity_val_steps validation batches, results and logs discarded (run_controls.cc).
  void RunSanityCheck(TrainingModule& module, const Dataset& val);
  void RunEpoch(State& loop);
  at::Tensor TrainStep(State& loop, Batch batch, int64_t i);
  double SyncStep(State& loop, double overflow);
  void DiscardStep(State& loop);
  void OptimizerStep(State& loop, bool skip);
  void OnStepEnd(State& loop);
  void OnEpochEnd(State& loop);
  std::string SaveLast(State& loop);
  void FinishFit(State& loop);

  Trainer& t_;
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_LOOPS_INTERNAL_FIT_LOOP_H_
