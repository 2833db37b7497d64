// Callbacks: code the Trainer runs at fixed points of Fit (Lightning's
// Callback), given in TrainerOptions::callbacks, and three implementations:
//
//   ModelCheckpoint       checkpoints every N training steps and/or epochs,
//                         last.ckpt, and the top k by a monitored metric
//   LearningRateMonitor   logs each parameter group's learning rate to the loggers
//   EarlyStopping         stops Fit when a monitored metric stops improving
//
//   TrainerOptions o;
//   ModelCheckpointOptions mc;
//   mc.monitor = "val_loss"; mc.save_top_k = 2; mc.save_last = true;
//   o.callbacks = {std::make_shared<ModelCheckpoint>(mc), std::make_shared<EarlyStopping>()};
//
// Every rank runs every callback at the same points. Metrics
// (Trainer::callback_metrics: train_loss, val_loss and what the module
// log()s) are reduced over the ranks, so they are identical on every rank;
// decisions that change the run (EarlyStopping) are additionally taken on
// rank 0 and broadcast, and the Trainer all-reduces its stop flag, so every
// rank stops after the same step. Checkpoint saves are collective (every rank
// calls Trainer::SaveCheckpoint); files are written and deleted by rank 0 (or
// by every rank for its own shard file in sharded checkpoints).
//
// A callback's state_dict() is stored in checkpoints under its state_key() and
// restored on resume (ModelCheckpoint's best models, EarlyStopping's counters).
//
// The three implementations live beside this file, one per header:
// model_checkpoint.h, learning_rate_monitor.h, early_stopping.h.
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_CALLBACK_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_CALLBACK_H_

#include <ATen/core/Tensor.h>

#include <exception>
#include <map>
#include <memory>
#include <string>

#include "trainer/checkpoint_io/state_value.h"
#include "trainer/data/data.h"

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::trainer {

class Trainer;
class TrainingModule;

class Callback {
 public:
  virtual ~Callback() = default;

  // After setup and any resume, before the first batch.
  virtual void on_fit_start(Trainer& trainer, TrainingModule& module) {}
  // After the last checkpoint of Fit.
  virtual void on_fit_end(Trainer& trainer, TrainingModule& module) {}
  // After every training batch (micro-batch), once the optimizer step it
  // completes (if any) is done: trainer.global_step() counts it. A stop
  // requested here (trainer.set_should_stop) on any rank ends Fit after this
  // step on every rank (see Trainer::set_should_stop).
  virtual void on_train_batch_end(Trainer& trainer, TrainingModule& module, const at::Tensor& loss,
                                  int64_t batch_idx) {}
  // Before and after each validation pass, in Fit and in Trainer::Validate
  // (trainer.fitting() tells which); at the end callback_metrics has val_loss.
  virtual void on_validation_start(Trainer& trainer, TrainingModule& module) {}
  virtual void on_validation_end(Trainer& trainer, TrainingModule& module) {}
  // ---- Test and the evaluation epoch ends ----
  // Around Trainer::Test; at the end callback_metrics has the test metrics.
  virtual void on_test_start(Trainer& trainer, TrainingModule& module) {}
  virtual void on_test_end(Trainer& trainer, TrainingModule& module) {}
  // After a validation / test pass, once its metrics are in callback_metrics
  // (and after the module's hook of the same name), before they are logged.
  virtual void on_validation_epoch_end(Trainer& trainer, TrainingModule& module) {}
  virtual void on_test_epoch_end(Trainer& trainer, TrainingModule& module) {}
  // Before the first batch of training epoch `epoch` (0-based; not when a
  // resumed Fit continues an epoch mid-way), after the module's hook.
  virtual void on_train_epoch_start(Trainer& trainer, TrainingModule& module, int64_t epoch) {}
  // After training epoch `epoch` (0-based) ended; trainer.current_epoch() is
  // already epoch + 1 (a checkpoint taken here resumes with the next epoch).
  virtual void on_train_epoch_end(Trainer& trainer, TrainingModule& module, int64_t epoch) {}

  // ---- Hooks of the training step, checkpoints and failures ---------------
  // Each runs on every rank, after the module's hook of the same name
  // (trainer/training_module.h describes the order within a step).
  // Before training_step of every micro-batch (the batch is on the device).
  virtual void on_train_batch_start(Trainer& trainer, TrainingModule& module, const Batch& batch,
                                    int64_t batch_idx) {}
  // Before backward of every micro-batch; `loss` is what backward gets (the
  // loss / accumulate_grad_batches, before 16-mixed scaling).
  virtual void on_before_backward(Trainer& trainer, TrainingModule& module, const at::Tensor& loss) {}
  virtual void on_after_backward(Trainer& trainer, TrainingModule& module) {}
  // Once per optimizer step, after the step's collective (gradients
  // synchronized and unscaled), before clipping and optimizer.step().
  virtual void on_before_optimizer_step(Trainer& trainer, TrainingModule& module,
                                        torch::optim::Optimizer& optimizer) {}
  // Extra checkpoint state shared with the module (see
  // TrainingModule::on_save_checkpoint): written at every save (full or
  // sharded), read back on resume before on_fit_start.
  virtual void on_save_checkpoint(Trainer& trainer, TrainingModule& module,
                                  std::map<std::string, std::string>& checkpoint) {}
  virtual void on_load_checkpoint(Trainer& trainer, TrainingModule& module,
                                  const std::map<std::string, std::string>& checkpoint) {}
  // Fit is failing with `e` (Preempted included), after the module's
  // on_exception; then `e` propagates. Exceptions thrown here are logged and dropped.
  virtual void on_exception(Trainer& trainer, TrainingModule& module, const std::exception& e) {}

  // Key under which the state is checkpointed ("" = stateless). Lightning
  // finds a callback's state by this key: the built-in callbacks use
  // Lightning's own ("EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}").
  virtual std::string state_key() const { return ""; }
  // The key an earlier release used ("" = none), tried when state_key() is not in a checkpoint.
  virtual std::string legacy_state_key() const { return ""; }
  // The state as text (the form of earlier releases) ...
  virtual std::map<std::string, std::string> state_dict() const { return {}; }
  virtual void load_state_dict(const std::map<std::string, std::string>& state) {}
  // ... or with types, as the checkpoint holds it. The defaults convert:
  // checkpoint_state() reads state_dict()'s text as the int, float or bool it
  // spells (StateValue::Infer), load_checkpoint_state() hands
  // load_state_dict() each value's text. Override these for Python types of
  // your own (a score as a tensor: ScoreTensor).
  virtual StateDict checkpoint_state() const { return InferTypes(state_dict()); }
  virtual void load_checkpoint_state(const StateDict& state) { load_state_dict(ToStrings(state)); }
};

using CallbackPtr = std::shared_ptr<Callback>;

// The key of the checkpoint's "callbacks" entry that holds the extra state of
// on_save_checkpoint / on_load_checkpoint (reserved: no callback's state_key).
inline constexpr char kExtraStateKey[] = "on_save_checkpoint";

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_CALLBACK_H_
