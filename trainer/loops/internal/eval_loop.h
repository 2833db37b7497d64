// Internal to //trainer: the evaluation loop of validation (in Fit and
// Trainer::Validate), Trainer::Test and Trainer::Predict — this rank's
// DistributedSampler share in batches, the model in eval mode without
// gradients, the reduced metrics with their hooks and logging, Predict's
// gather in dataset order. Owned by the Trainer, working on its state.
#ifndef SHARDTRAIN_TRAINER_LOOPS_INTERNAL_EVAL_LOOP_H_
#define SHARDTRAIN_TRAINER_LOOPS_INTERNAL_EVAL_LOOP_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "trainer/data_module.h"  // Stage

namespace shardtrain::trainer {

class Trainer;
class TrainingModule;
class Dataset;
struct Batch;
struct PredictOptions;

namespace internal {

class EvalLoop {
 public:
  enum class EvalStage { kValidation, kTest };

  explicit EvalLoop(Trainer& trainer) : t_(trainer) {}
  EvalLoop(const EvalLoop&) = delete;
  EvalLoop& operator=(const EvalLoop&) = delete;

  // One validation pass; its mean val_loss (NaN when validation_step returns nothing).
  double RunValidation(TrainingModule& module, const Dataset& val);
  // One validation or test pass with its hooks; returns the metrics row
  // (the loss and what the module log()ged, reduced over batches and ranks).
  std::map<std::string, double> RunEvalStage(TrainingModule& module, const Dataset& data, EvalStage stage);
  // Processes and model for Test/Predict (`what`), after checking the call
  // (not inside Fit) and the data (not empty).
  void SetupForEval(TrainingModule& module, const char* what, const Dataset& data);
  // Trainer::Predict after SetupForEval.
  at::Tensor Predict(TrainingModule& module, const Dataset& data, const PredictOptions& options);

 private:
  // The epoch-end hooks of a validation or test pass.
  void RunEvalEpochEnd(TrainingModule& module, bool test, std::map<std::string, double>& row);
  // Calls fn(batch, batch_idx, real) for this rank's batches of `data` (as
  // many as LimitBatches(options, stage) allows), the model in eval mode
  // under NoGradGuard; `real`: the batch's samples that are not padding
  // duplicates. With trim_padding the duplicates are cut from the batch (it
  // may be left empty: it still runs, since the forward is collective).
  // fn returns false to stop.
  void ForEachEvalBatch(const Dataset& data, Stage stage, bool trim_padding,
                        const std::function<bool(const Batch&, int64_t, int64_t)>& fn);

  Trainer& t_;
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_LOOPS_INTERNAL_EVAL_LOOP_H_
