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

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strategies/strategy.h"
#include "trainer/checkpoint_io/state_value.h"
#include "trainer/data/data.h"
#include "trainer/optim/lr_scheduler.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer {

class Trainer;
namespace internal {
class MetricCollector;
class FitLoop;
class EvalLoop;
}

// Options of TrainingModule::Log (Lightning's self.log arguments).
struct LogOptions {
  // Log this batch's value at the optimizer step (logged rows respect
  // TrainerOptions::log_every_n_steps). Unset: true in training (training_step
  // and the training hooks), false in validation.
  std::optional<bool> on_step;
  // Aggregate the values of all the epoch's batches (or of the validation
  // run) with reduce_fx and log the result at its end. Unset: false in
  // training, true in validation. With on_step and on_epoch both, the names
  // logged are <name>_step and <name>_epoch (Lightning's); with one: <name>.
  std::optional<bool> on_epoch;
  // Show the value on the progress bar (trainer/callbacks/progress.h).
  bool prog_bar = false;
  // Reduce the value over the ranks with reduce_fx (in the step's one
  // all-reduce); false: rank 0's value is logged (as Lightning's loggers do).
  bool sync_dist = false;
  // "mean" (over batches, each weighing 1; with sync_dist over the batches of
  // all ranks), "sum", "max" or "min".
  std::string reduce_fx = "mean";
};

// What configure_optimizers returns (Lightning's optimizer / lr_scheduler
// dict). One optimizer per module: docs/lr_schedulers.md says why several
// are not supported (a scheduler of another optimizer is an error at Fit).
struct OptimizerConfig {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  // Optional learning-rate schedule (LambdaLR): before optimizer step s (0-based
  // global step) every parameter group's lr is its initial lr * lr_lambda(s).
  // The Trainer runs it as a LambdaLR stepped every optimizer step (after
  // the schedulers below).
  std::function<double(int64_t step)> lr_lambda;
  // Learning-rate schedulers (trainer/optim/lr_scheduler.h), each with its
  // interval ("step" / "epoch"), frequency and, for ReduceLROnPlateau, the
  // monitored metric; stepped in this order; state saved in checkpoints.
  std::vector<LRSchedulerConfig> lr_schedulers;
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
  // Hyperparameters written to hparams.yaml and the checkpoint's
  // "hyper_parameters" (with their types, as Lightning's save_hyperparameters
  // keeps them: Python's LightningModule.load_from_checkpoint passes them to
  // __init__). Override either: hyper_parameters() with typed values,
  //   StateDict hyper_parameters() const override { return {{"width", 64}, {"lr", 3e-4}, {"act", "gelu"}}; }
  // or hparams() with text, which the default hyper_parameters() reads as the
  // int, float or bool it spells (StateValue::Infer; "64" -> 64, "gelu" -> "gelu").
  virtual std::map<std::string, std::string> hparams() const { return {}; }
  virtual StateDict hyper_parameters() const { return InferTypes(hparams()); }

  // Called on every rank once the strategy has wrapped the model that
  // configure_model built (after WrapModel, before configure_optimizers), in
  // every Fit, Validate, Test and Predict: the place to load pretrained
  // weights into a sharded model, each rank into its own shards (e.g.
  // examples/llama/hf_strategy_io.h); strategy().module() is the model.
  // A checkpoint that Fit resumes from is loaded after it.
  virtual void on_model_wrapped() {}
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

  // ---- Hooks of the training step, checkpoints and failures ---------------
  // Each runs on every rank, before the callbacks' hook of the same name
  // (trainer/callbacks/callback.h). Per micro-batch, in this order:
  //   on_train_batch_start(batch, i)   before training_step (batch on the device)
  //   training_step(batch, i)
  //   on_before_backward(loss)         `loss` is what backward gets: the step's
  //                                    loss / accumulate_grad_batches, before
  //                                    16-mixed scaling
  //   backward                         (gradients synchronized on the step's last micro-batch)
  //   on_after_backward()
  //   on_train_batch_end(loss, i)      (module; the callbacks' run after the step)
  // and on the step's last micro-batch, after the step's collective:
  //   on_before_optimizer_step(opt)    gradients synchronized and (16-mixed)
  //                                    unscaled, before clipping and step; also
  //                                    when 16-mixed skips the step
  virtual void on_train_batch_start(const Batch& batch, int64_t batch_idx) {}
  virtual void on_before_backward(const at::Tensor& loss) {}
  virtual void on_after_backward() {}
  virtual void on_before_optimizer_step(torch::optim::Optimizer& optimizer) {}
  // Extra state kept in checkpoints (Lightning's checkpoint dict): written
  // into `checkpoint` while every checkpoint is saved (full or sharded; on
  // every rank, rank 0's is stored), read back on resume (Fit's ckpt_path),
  // after model, optimizer and callback states, before on_fit_start. The
  // module and the callbacks share one map (stored under kExtraStateKey of
  // the checkpoint's "callbacks" entry); on_load_checkpoint gets it empty
  // when the checkpoint holds none.
  virtual void on_save_checkpoint(std::map<std::string, std::string>& checkpoint) {}
  virtual void on_load_checkpoint(const std::map<std::string, std::string>& checkpoint) {}
  // Fit is failing with `e` (any exception, Preempted included): runs on
  // every rank that throws, before the callbacks' on_exception, then `e`
  // propagates. An exception thrown by the hook itself is logged and dropped.
  virtual void on_exception(const std::exception& e) {}
  // ---- Test, Predict and the evaluation epoch ends (defaults in trainer/loops/eval_loop.cc) ----
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
  // Lightning's self.log(name, value, on_step=, on_epoch=, prog_bar=,
  // sync_dist=, reduce_fx=): see LogOptions. Values logged in one step
  // travel in the step's one all-reduce; the last value a step logs under a
  // name is its step value. Every rank must log the same names in every
  // step and validation run (else every rank throws InvalidArgumentError
  // naming the names that differ). In training: the step values in
  // callback_metrics after every step and in the logged row every
  // log_every_n_steps; the epoch aggregates at the end of the epoch (before
  // on_train_epoch_end; an epoch cut short by a stop or resumed from a
  // mid-epoch checkpoint aggregates the batches this Fit ran). In
  // validation: the aggregates with val_loss. Throws InvalidArgumentError for
  // an unknown reduce_fx, or on_step in validation.
  void Log(const std::string& name, double value, const LogOptions& options = {});
  // Today's shorthand: Log(name, value, {.sync_dist = true}), i.e. in
  // training_step the rank mean added to the step's row, in validation_step
  // the mean over the batches of all ranks, logged with val_loss.
  void log(const std::string& name, double value) {
    LogOptions o;
    o.sync_dist = true;
    Log(name, value, o);
  }

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
  friend class internal::MetricCollector;
  friend class internal::FitLoop;  // the loop position and what the steps log()
  friend class internal::EvalLoop;
  strategies::Strategy* strategy_ = nullptr;
  Trainer* trainer_ = nullptr;
  std::map<std::string, double> logged_;
  // ---- Log options (trainer/connectors/internal/metric_log.h) ----
  // Log's options of each name in logged_, on_step/on_epoch resolved.
  std::map<std::string, LogOptions> log_options_;
  bool log_eval_defaults_ = false;  // unset on_step/on_epoch as in validation/test (set by the Trainer)
  int64_t epoch_ = 0;
  int64_t global_step_ = 0;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_TRAINING_MODULE_H_
