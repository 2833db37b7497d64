// The fit loop (trainer/loops/internal/fit_loop.h): Trainer::Fit's steps
// (train step, the step's one collective, optimizer step, end of step, end of
// epoch, end of fit), in the order of Lightning's fit loop.
#include "trainer/loops/internal/fit_loop.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <signal.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <string_view>
#include <tuple>

#include "base/errors.h"
#include "base/file_util.h"
#include "base/logging.h"
#include "sharding/host_memory.h"
#include "trainer/callbacks/model_summary.h"
#include "trainer/callbacks/progress.h"
#include "trainer/checkpoint_io/resume.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"
#include "trainer/connectors/internal/checkpoint_connector.h"
#include "trainer/connectors/internal/data_connector.h"
#include "trainer/connectors/internal/logger_connector.h"
#include "trainer/connectors/internal/metric_log.h"
#include "trainer/connectors/internal/process_connector.h"
#include "trainer/connectors/internal/profiling_connector.h"
#include "trainer/loops/internal/eval_loop.h"
#include "trainer/loops/internal/loss_sum.h"
#include "trainer/loops/internal/lr_stepping.h"
#include "trainer/loops/run_controls.h"
#include "trainer/stop_signals.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

static_assert(std::string_view(kCompleteMarkerName) == std::string_view(kShardedCompleteMarker),
              "trainer/checkpoint_io/resume.h must recognize complete sharded checkpoints");

// ---- Fit, step by step (the order of Lightning's fit loop) ------------------

// What one Fit carries from step to step.
struct internal::FitLoop::State {
  TrainingModule& module;
  const Dataset& train;
  const Dataset* val;
  DistributedSampler sampler;
  int64_t nb = 0;         // training batches per rank per epoch
  int64_t val_every = 1;  // validate after every val_every training batches
  strategies::GradClipAlgorithm clip_algo;
  bool builtin_checkpoints = true;
  std::unique_ptr<ProgressReporter> progress;
  internal::LossSum losses;  // this optimizer step's micro-batch losses (this rank)
  double step_loss = 0;                         // agreed by SyncStep
  std::map<std::string, double> step_metrics;  // agreed by SyncStep
  int stop_signal = 0;                          // agreed by SyncStep: stop after this step, then save
  std::vector<double> save_slots{0.0, 0.0};     // SyncStep: the async save's slots, summed (checkpoint_connector.h)
  bool stop = false;
  // A stop request this rank made before the step's first micro-batch (in
  // on_train_batch_end of the step before); agreed by SyncStep, it discards
  // the step (DiscardStep).
  bool stop_before_step = false;
  bool discard = false;                 // agreed by SyncStep
  // The CPU generator's state at the current step's first micro-batch (W > 1
  // only): a discarded step puts it back, so the checkpoint written at the
  // stop holds the state an uninterrupted run would have had there.
  at::Tensor rng_at_step_start;
  internal::MetricCollector metrics;    // what the module Log()s (trainer/connectors/internal/metric_log.h)
  // The state the last checkpoint written by this Fit holds (SaveLast links instead of writing it again).
  std::tuple<int64_t, int64_t, int64_t> saved_at{-1, -1, -1};
  std::string saved_path;
};

void internal::FitLoop::Run(TrainingModule& module, const Dataset& train, const Dataset* val,
                            const std::string& ckpt_path) {
  struct FittingScope {
    bool& flag;
    explicit FittingScope(bool& f) : flag(f) { flag = true; }
    ~FittingScope() { flag = false; }
  } fitting(t_.fitting_);
  // Leaving by an exception: the asynchronous save in flight is dropped (its
  // writer joined); the normal end completed it in FinishFit.
  struct AbandonAsyncSaveOnThrow {
    internal::CheckpointConnector& connector;
    ~AbandonAsyncSaveOnThrow() { connector.AbandonAsyncSave(); }
  } abandon_async_save{*t_.checkpoint_connector_};
  StopSignalScope stop_signals;  // before SetupProcesses: the launcher's forwarding chains to it
  t_.process_connector_->SetupProcesses();
  const auto& o = t_.options_;
  const int W = t_.world_size();
  t_.fit_train_batches_ = t_.NumTrainingBatches(train, t_.data_parallel_size());  // a set-up strategy's
  {
    struct CountInSetup {  // SetupModel counts again once the strategy is set up
      Trainer& t;
      ~CountInSetup() { t.fit_train_set_ = nullptr; }
    } count{t_};
    t_.fit_train_set_ = &train;
    t_.SetupModel(module);
  }
  t_.callback_metrics_.clear();
  t_.should_stop_ = false;
  // Resume before the loggers make this run's version_N: a failed resume leaves no empty one.
  const std::string resume_from = t_.checkpoint_connector_->ResolveCheckpointPath(ckpt_path);
  if (!resume_from.empty()) {
    t_.checkpoint_connector_->Restore(resume_from);
    sharding::ReleaseHostBlockCache();  // what the load read is not what the steps need
  }
  t_.logger_connector_->SetupLoggers(module);
  ProfilingConnector::FitScope profiling(
      *t_.profiling_connector_);  // profiler="simple"/"pytorch" (trainer/profilers/profiler.h)
  t_.step_losses_.clear();
  t_.val_losses_.clear();
  const Dataset* val_set = internal::FitValidationSet(o, train, val);  // overfit_batches: the training set
  State loop{module,
             train,
             val_set,
             DistributedSampler(train.size(), t_.data_parallel_size(), t_.data_parallel_rank(), o.shuffle, o.seed,
                                /*drop_last=*/false),
             t_.fit_train_batches_,
             1,
             strategies::ParseGradClipAlgorithm(o.gradient_clip_algorithm)};
  loop.builtin_checkpoints = o.enable_checkpointing;
  loop.metrics = internal::MetricCollector({t_.world_.get(), t_.rank(), W, [this](std::vector<double> v) {
                                              return t_.process_connector_->AllReduceSum(std::move(v));
                                            }});
  for (const auto& cb : o.callbacks) {
    if (dynamic_cast<ModelCheckpoint*>(cb.get())) loop.builtin_checkpoints = false;
  }
  ST_CHECK_ARG(loop.nb > 0, "no training batches: dataset of ", train.size(), " samples, ", W, " ranks, batch_size ",
               o.batch_size, ", limit_train_batches ", o.limit_train_batches);
  loop.val_every = o.val_check_interval > 1.0 ? static_cast<int64_t>(o.val_check_interval)
                                              : std::max<int64_t>(1, static_cast<int64_t>(std::floor(
                                                                         loop.nb * o.val_check_interval)));
  if (t_.rank() == 0 && o.enable_progress_bar) {
    loop.progress = std::make_unique<ProgressReporter>(t_.estimated_stepping_batches(), o.log_every_n_steps);
  }
  if (o.enable_model_summary && t_.rank() == 0) {
    std::fputs(FormatModelSummary(SummarizeModel(*t_.strategy_, t_.optimizer())).c_str(), stdout);
    std::fflush(stdout);
  }
  module.on_fit_start();
  for (auto& cb : o.callbacks) cb->on_fit_start(t_, module);
  t_.strategy_->module().train();
  loop.stop = o.max_steps >= 0 && t_.global_step_ >= o.max_steps;
  internal::RunExplainingNondeterminism(o.deterministic, [&] {
    if (loop.val) RunSanityCheck(module, *loop.val);
    while (!loop.stop && (t_.max_epochs_ < 0 || t_.epoch_ < t_.max_epochs_)) RunEpoch(loop);
  });
  FinishFit(loop);
}

void internal::FitLoop::RunEpoch(State& loop) {
  const auto& o = t_.options_;
  TrainingModule& module = loop.module;
  loop.sampler.set_epoch(t_.epoch_);
  module.epoch_ = t_.epoch_;
  if (t_.batch_in_epoch_ == 0) {
    module.on_train_epoch_start(t_.epoch_);
    for (auto& cb : o.callbacks) cb->on_train_epoch_start(t_, module, t_.epoch_);
  }
  loop.losses.Reset();
  // Prepared ahead by num_workers threads (in this order), from batch_in_epoch_ (a resumed epoch) on.
  DataLoader loader(loop.train, MakeBatches(loop.sampler.indices(), o.batch_size, o.drop_last),
                    t_.data_connector_->LoaderOptions(), std::min(t_.batch_in_epoch_, loop.nb), loop.nb);
  for (int64_t i = t_.batch_in_epoch_; i < loop.nb; ++i) {
    const bool sync = (i + 1) % o.accumulate_grad_batches == 0 || i + 1 == loop.nb;
    if (i % o.accumulate_grad_batches == 0) {
      loop.stop_before_step = t_.should_stop_;
      if (t_.world_size() > 1) loop.rng_at_step_start = at::detail::getDefaultCPUGenerator().get_state();
    }
    auto fetch = t_.Profile(kActionGetTrainBatch);
    Batch next = loader.Next();
    fetch.Stop();
    const at::Tensor loss = TrainStep(loop, std::move(next), i);
    if (sync) {
      // 16-mixed: the overflow flag joins the step's one collective (Unscale's reduce callback);
      // so does the non-finite check's flag (trainer/loops/nonfinite.h; 0 when off).
      const double bad = t_.nonfinite_.enabled()
                             ? t_.nonfinite_.LocalFlag(loop.losses.Read() / loop.losses.count(), t_.strategy_->named_parameters())
                             : 0;
      double slot = 0;
      const auto sync_step = [&](double overflow) { return slot = SyncStep(loop, (overflow > 0) + bad); };
      bool skip = t_.scaler_ ? t_.scaler_->Unscale(t_.strategy_->parameters(), sync_step) : sync_step(0) > 0;
      if (loop.discard) {
        DiscardStep(loop);
        break;
      }
      skip = t_.nonfinite_.Decide(slot, t_.global_step_, t_.rank()) || skip;
      OptimizerStep(loop, skip);
      OnStepEnd(loop);
    }
    // A stop requested here reaches the other ranks in the next collective:
    // after validation or at the epoch end (SyncShouldStop), else with the
    // next step's (SyncStep), which then discards that step.
    auto hooks = t_.Profile(kActionCallbacksOnTrainBatchEnd);
    for (auto& cb : o.callbacks) cb->on_train_batch_end(t_, module, loss, i);
    hooks.Stop();
    if (sync && t_.should_stop_ && t_.world_size() == 1) loop.stop = true;  // nobody to tell
    if (loop.val && (i + 1) % loop.val_every == 0 && internal::ValidatesInEpoch(o, t_.epoch_)) {
      t_.eval_loop_->RunValidation(module, *loop.val);
      t_.SyncShouldStop();
      if (t_.should_stop_ && sync) loop.stop = true;
    }
    if (loop.stop) break;
  }
  if (t_.batch_in_epoch_ >= loop.nb) OnEpochEnd(loop);
}

// training_step and backward of one micro-batch; returns its (detached) loss.
at::Tensor internal::FitLoop::TrainStep(State& loop, Batch batch, int64_t i) {
  const auto& o = t_.options_;
  const bool sync = (i + 1) % o.accumulate_grad_batches == 0 || i + 1 == loop.nb;
  Batch b = t_.ToDevice(std::move(batch));
  TrainingModule& module = loop.module;
  module.on_train_batch_start(b, i);
  for (auto& cb : o.callbacks) cb->on_train_batch_start(t_, module, b, i);
  auto forward = t_.Profile(kActionTrainingStep);
  at::Tensor loss = module.training_step(b, i);
  forward.Stop();
  loop.losses.Add(loss);  // before backward: reading the step's sum then waits for no backward
  if (t_.sync_bn_) t_.sync_bn_->CheckNotBypassed();  // once: the model reached the SyncBatchNorm layers
  at::Tensor to_backward = o.accumulate_grad_batches > 1 ? loss / static_cast<double>(o.accumulate_grad_batches) : loss;
  module.on_before_backward(to_backward);
  for (auto& cb : o.callbacks) cb->on_before_backward(t_, module, to_backward);
  if (t_.scaler_) to_backward = t_.scaler_->Scale(to_backward);
  auto backward = t_.Profile(kActionBackward);
  t_.strategy_->Backward(to_backward, sync);
  backward.Stop();
  module.on_after_backward();
  for (auto& cb : o.callbacks) cb->on_after_backward(t_, module);
  auto hook = t_.Profile(kActionOnTrainBatchEnd);
  module.on_train_batch_end(loss.detach(), i);
  hook.Stop();
  loop.metrics.AddBatch(module);
  t_.batch_in_epoch_ = i + 1;
  return loss.detach();
}

// The step's one collective: [loss, overflow, stop before the step, stop,
// SIGTERM, SIGINT, SIGUSR1, async save finished, async save failed] and what the module Log()ged in the step
// (trainer/connectors/internal/metric_log.h) summed over the ranks. Sets the agreed loss,
// metrics, stop flags and stop signal in `loop`; returns the overflow slot's
// sum (> 0: some rank overflowed or found a non-finite value, trainer/loops/nonfinite.h).
double internal::FitLoop::SyncStep(State& loop, double overflow) {
  constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1};
  const int received = ReceivedStopSignal();
  std::vector<double> v = {loop.losses.Read() / static_cast<double>(loop.losses.count()), overflow, loop.stop_before_step ? 1.0 : 0.0,
                           t_.should_stop_ ? 1.0 : 0.0};
  for (int sig : kSignals) v.push_back(received == sig ? 1.0 : 0.0);
  for (double slot : t_.checkpoint_connector_->AsyncSaveSlots()) v.push_back(slot);
  v = loop.metrics.SyncStep(std::move(v));
  loop.save_slots = {v[7], v[8]};
  const double W = t_.world_size();
  loop.step_loss = v[0] / W;
  loop.discard = v[2] > 0;
  if (v[3] > 0) {  // requested before this step's collective: Fit ends after this step
    t_.should_stop_ = true;
    loop.stop = true;
  }
  loop.stop_signal = 0;
  for (int s = 2; s >= 0; --s) {  // SIGUSR1, SIGINT, SIGTERM: the first wins where ranks got different ones
    if (v[4 + s] > 0) loop.stop_signal = kSignals[s];
  }
  loop.step_metrics = loop.metrics.step_metrics();
  return v[1];
}

// A stop that some rank requested after the previous step's collective (in
// on_train_batch_end) arrived with this step's: as in Lightning, Fit ends
// after the step that requested it, so this step's micro-batches are
// dropped: no optimizer step, gradients zeroed, the loop position back at
// the step's first micro-batch (a checkpoint resumes there), the CPU
// generator's state as it was there. Their forward, backward and batch hooks
// did run.
void internal::FitLoop::DiscardStep(State& loop) {
  t_.opt_.optimizer->zero_grad();
  if (loop.rng_at_step_start.defined()) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    gen.set_state(loop.rng_at_step_start);
  }
  t_.batch_in_epoch_ -= loop.losses.count();
  loop.losses.Reset();
  loop.stop = true;
}

// Clipping, optimizer.step (unless the 16-mixed scaler found an overflow on
// any rank), the scaler's update and zero_grad. (The LR schedulers step in
// OnStepEnd.)
void internal::FitLoop::OptimizerStep(State& loop, bool skip) {
  auto profiled = t_.Profile(kActionOptimizerStep);
  const auto& o = t_.options_;
  loop.module.on_before_optimizer_step(*t_.opt_.optimizer);
  for (auto& cb : o.callbacks) cb->on_before_optimizer_step(t_, loop.module, *t_.opt_.optimizer);
  if (!skip && o.gradient_clip_val > 0) {
    // By norm without reading it: on a GPU the optimizer step queues behind the clip, no host wait.
    if (loop.clip_algo == strategies::GradClipAlgorithm::kNorm) {
      t_.strategy_->ClipGradNormOnDevice(o.gradient_clip_val);
    } else {
      t_.strategy_->ClipGradValue(o.gradient_clip_val);
    }
  }
  if (!skip) t_.checkpoint_connector_->StepOptimizer();  // unit by unit while an async save is in flight
  if (t_.scaler_) t_.scaler_->Update(skip);
  t_.opt_.optimizer->zero_grad();
}

// After an optimizer step: count it, publish and log the agreed loss and
// metrics, report progress, write the periodic checkpoint, decide to stop.
void internal::FitLoop::OnStepEnd(State& loop) {
  const auto& o = t_.options_;
  t_.checkpoint_connector_->AfterAsyncSaveSlots(loop.save_slots);  // completes or reports a background save
  ++t_.global_step_;
  loop.module.global_step_ = t_.global_step_;
  const double l = loop.step_loss;
  loop.losses.Reset();
  t_.step_losses_.push_back(l);
  std::map<std::string, double> row = loop.step_metrics;
  for (const auto& [k, v] : row) t_.callback_metrics_[k] = v;
  t_.callback_metrics_["train_loss"] = l;
  if (!t_.loggers().empty() && t_.global_step_ % o.log_every_n_steps == 0) {
    row["train_loss"] = l;
    row["epoch"] = static_cast<double>(t_.epoch_);
    row["lr"] = t_.opt_.optimizer->param_groups()[0].options().get_lr();
    if (t_.scaler_) row["grad_scale"] = t_.scaler_->scale();
    t_.LogMetrics(row, t_.global_step_);
  }
  if (loop.progress) loop.progress->Update(t_.epoch_, t_.global_step_, l, loop.metrics.prog_bar());
  t_.lr_stepping_->Step("step", t_.global_step_);  // interval "step" (trainer/loops/lr_stepping.cc)
  if (loop.builtin_checkpoints && o.checkpoint_every_n_steps > 0 && t_.global_step_ % o.checkpoint_every_n_steps == 0) {
    loop.saved_path = (fs::path(t_.ckpt_dir_) / ("step=" + std::to_string(t_.global_step_) + ".ckpt")).string();
    t_.SaveCheckpoint(loop.saved_path);
    loop.saved_at = {t_.global_step_, t_.epoch_, t_.batch_in_epoch_};
  }
  if (o.max_steps >= 0 && t_.global_step_ >= o.max_steps) loop.stop = true;
  if (loop.stop_signal != 0) loop.stop = true;
}

void internal::FitLoop::OnEpochEnd(State& loop) {
  // The epoch aggregates of what the module Log()ged with on_epoch (one
  // all-reduce, only when there are any), before the epoch-end hooks see them.
  if (loop.metrics.has_epoch_values()) {
    std::map<std::string, double> row = loop.metrics.ReduceEpoch("training", /*names_agreed=*/true);
    for (const auto& [k, v] : row) t_.callback_metrics_[k] = v;
    row["epoch"] = static_cast<double>(t_.epoch_);
    t_.LogMetrics(row, t_.global_step_);
  }
  auto hooks = t_.Profile(kActionOnTrainEpochEnd);
  loop.module.on_train_epoch_end(t_.epoch_);
  const int64_t finished = t_.epoch_;
  ++t_.epoch_;
  t_.batch_in_epoch_ = 0;
  t_.lr_stepping_->Step("epoch", t_.epoch_);  // interval "epoch", after the epoch's validation
  for (auto& cb : t_.options_.callbacks) cb->on_train_epoch_end(t_, loop.module, finished);
  hooks.Stop();
  t_.SyncShouldStop();
  if (t_.should_stop_) loop.stop = true;
  if (loop.builtin_checkpoints) SaveLast(loop);
}

// <checkpoint_dir>/last.ckpt for the current state. When this Fit's last
// checkpoint already holds it: nothing (it was last.ckpt) or a hard link to
// that full checkpoint file (step=N.ckpt at the final step: one copy on disk).
std::string internal::FitLoop::SaveLast(State& loop) {
  const std::string last = (fs::path(t_.ckpt_dir_) / "last.ckpt").string();
  const std::tuple<int64_t, int64_t, int64_t> now{t_.global_step_, t_.epoch_, t_.batch_in_epoch_};
  if (loop.saved_at == now && loop.saved_path == last) return last;
  if (loop.saved_at == now) {
    const bool linked = t_.rank() == 0 && LinkFileAtomically(loop.saved_path, last);
    if (t_.process_connector_->AllReduceSum({linked ? 1.0 : 0.0})[0] > 0) {
      t_.last_ckpt_ = last;
      loop.saved_path = last;
      return last;
    }
  }
  t_.SaveCheckpoint(last);
  loop.saved_at = now;
  loop.saved_path = last;
  return last;
}

void internal::FitLoop::FinishFit(State& loop) {
  // The steps' freed host blocks were kept for the next step: there is none.
  sharding::ReleaseHostBlockCache();
  std::string saved;
  if (loop.stop_signal != 0 && t_.options_.enable_checkpointing) {
    saved = SaveLast(loop);
  } else if (loop.builtin_checkpoints) {
    SaveLast(loop);
  }
  t_.checkpoint_connector_->FinishAsyncSave();  // the end of Fit and preemption wait for the save in flight
  if (loop.progress) loop.progress->Finish();
  t_.logger_connector_->Save();
  if (Profiler* profiler = t_.profiling_connector_->profiler()) profiler->Report();
  if (loop.stop_signal != 0) {
    const int sig = loop.stop_signal;
    std::ostringstream msg;
    msg << "stopped by " << StopSignalName(sig) << " after global step " << t_.global_step_ << " (epoch " << t_.epoch_
        << "); " << (saved.empty() ? std::string("checkpointing is off: nothing saved") : "saved " + saved)
        << "; resume with ckpt_path=\"last\" (--ckpt_path=last) or resume=\"auto\" (--resume=auto); exit status "
        << StopExitCode(sig);
    if (t_.rank() == 0) ST_LOG(WARNING) << msg.str();
    throw Preempted(sig, saved, msg.str());
  }
  loop.module.on_fit_end();
  for (auto& cb : t_.options_.callbacks) cb->on_fit_end(t_, loop.module);
}

}  // namespace shardtrain::trainer
