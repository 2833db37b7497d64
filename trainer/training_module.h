// TrainingModule: the LightningModule analogue. The user says what the model
// is, what one step computes and how to optimize; the Trainer does the loop,
// distribution, checkpointing and logging.
//
//   class MyModule : public TrainingModule {
//     std::shared_ptr<torch::nn::Module> configure_model() override { ... }   // declare wrap points here
//     at::Tensor training_step(const Batch& b, int64_t i) override {
//       at::Tensor out = forward([&] { return net_->forward(b.inputs); });  // through the strategy
//       return at::cross_entropy_loss(out, b.targets);
//     }
//     OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
//       return {std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3))};
//     }
//   };
//
// configure_optimizers receives the tensors the strategy wants optimized
// (shards for sharded strategies; named_parameters() gives them with names,
// e.g. for parameter groups with use_orig_params).
#ifndef SHARDTRAIN_TRAINER_TRAINING_MODULE_H_
#define SHARDTRAIN_TRAINER_TRAINING_MODULE_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strategies/strategy.h"
#include "trainer/data.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer {

class Trainer;

struct OptimizerConfig {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  // Optional learning-rate schedule (LambdaLR): before optimizer step s (0-based
  // global step) every parameter group's lr is its initial lr * lr_lambda(s).
  // A function of the step only, so resuming restores it exactly.
  std::function<double(int64_t step)> lr_lambda;
};

class TrainingModule {
 public:
  virtual ~TrainingModule() = default;

  // Builds the model (called once per fit, after seeding; every rank builds the same).
  virtual std::shared_ptr<torch::nn::Module> configure_model() = 0;
  // Returns the loss of one micro-batch on this rank.
  virtual at::Tensor training_step(const Batch& batch, int64_t batch_idx) = 0;
  // Returns the validation loss of one batch (logged as val_loss, averaged
  // over batches and ranks); std::nullopt = no validation.
  virtual std::optional<at::Tensor> validation_step(const Batch& batch, int64_t batch_idx) { return std::nullopt; }
  virtual OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) = 0;
  // Hyperparameters written to hparams.yaml and the checkpoint.
  virtual std::map<std::string, std::string> hparams() const { return {}; }

  virtual void on_fit_start() {}
  virtual void on_fit_end() {}
  virtual void on_train_epoch_start(int64_t epoch) {}
  virtual void on_train_epoch_end(int64_t epoch) {}
  // After every micro-batch; `loss` is this rank's unscaled loss.
  virtual void on_train_batch_end(const at::Tensor& loss, int64_t batch_idx) {}
  // Around every validation pass (in Fit and in Trainer::Validate), before
  // the callbacks' hooks of the same name.
  virtual void on_validation_start() {}
  virtual void on_validation_end() {}

  // ---- Test, Predict and the evaluation epoch ends (issue #16 loops; defaults in trainer/eval_loop.cc) ----
  // Trainer::Test: the mean loss of one test batch (test_loss), or
  // std::nullopt (then only what it log()s is reported). The batch holds no
  // padding duplicates, so on some ranks the last one can be smaller than
  // the batch size, or even empty (0 rows: it must still run the forward,
  // which is collective; what it returns and logs then counts for nothing).
  // What it log()s is averaged over the test set's samples, like the loss.
  // Default: throws
  // InvalidArgumentError (override it to use Trainer::Test).
  virtual std::optional<at::Tensor> test_step(const Batch& batch, int64_t batch_idx);
  // Trainer::Predict: the predictions for one batch, one row (dimension 0)
  // per sample, the same shape and dtype for every batch. Default: throws
  // InvalidArgumentError (override it to use Trainer::Predict).
  virtual at::Tensor predict_step(const Batch& batch, int64_t batch_idx);
  // Around Trainer::Test, before the callbacks' hooks of the same name.
  virtual void on_test_start() {}
  virtual void on_test_end() {}
  // After a validation / test pass, once its metrics are reduced over
  // batches and ranks and in trainer().callback_metrics(), before they are
  // logged and before the callbacks' hooks of the same name. Every rank calls
  // it (collectives allowed); a value log()ged here joins the pass's metrics
  // (rank-averaged).
  virtual void on_validation_epoch_end() {}
  virtual void on_test_epoch_end() {}

  // Runs the model's forward through the strategy (sharded gather, autocast).
  at::Tensor forward(const std::function<at::Tensor()>& fn) { return strategy().Forward(fn); }
  // Lightning's self.log: in training_step, a scalar added to the next
  // logged row (rank-averaged); in validation_step, averaged over the
  // validation batches and ranks and logged with val_loss. Every rank must
  // log the same names.
  void log(const std::string& name, double value) { logged_[name] = value; }

  strategies::Strategy& strategy();
  // The Trainer running this module (Lightning's self.trainer), e.g. for
  // trainer().estimated_stepping_batches() in configure_optimizers or
  // trainer().device(). Valid inside Fit/Validate.
  Trainer& trainer();
  // Names and tensors of what the strategy optimizes.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() { return strategy().named_parameters(); }
  int64_t current_epoch() const { return epoch_; }
  int64_t global_step() const { return global_step_; }

 private:
  friend class Trainer;
  strategies::Strategy* strategy_ = nullptr;
  Trainer* trainer_ = nullptr;
  std::map<std::string, double> logged_;
  int64_t epoch_ = 0;
  int64_t global_step_ = 0;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_TRAINING_MODULE_H_
