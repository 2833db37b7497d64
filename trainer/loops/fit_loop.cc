// Trainer::Fit and its steps (train step, the step's one collective,
// optimizer step, end of step, end of epoch, end of fit), in the order of
// Lightning's fit loop; split from trainer.cc.
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
#include "trainer/connectors/internal/metric_log.h"
#include "trainer/loops/run_controls.h"
#include "trainer/stop_signals.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

static_assert(std::string_view(kCompleteMarkerName) == std::string_view(kShardedCompleteMarker),
              "trainer/checkpoint_io/resume.h must recognize complete sharded checkpoints");

// ---- Fit, step by step (the order of Lightning's fit loop) ------------------

// What one Fit carries from step to step.
struct Trainer::FitLoop {
  TrainingModule& module;
  const Dataset& train;
  const Dataset* val;
  DistributedSampler sampler;
  int64_t nb = 0;         // training batches per rank per epoch
  int64_t val_every = 1;  // validate after every val_every training batches
  strategies::GradClipAlgorithm clip_algo;
  bool builtin_checkpoints = true;
  std::unique_ptr<ProgressReporter> progress;
  double acc_loss = 0;  // this optimizer step's micro-batch losses (this rank)
  int64_t acc_n = 0;
  double step_loss = 0;                         // agreed by SyncStep
  std::map<std::string, double> step_metrics;  // agreed by SyncStep
  int stop_signal = 0;                          // agreed by SyncStep: stop after this step, then save
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

void Trainer::Fit(TrainingModule& module, const Dataset& train, const Dataset* val, const std::string& ckpt_path) {
  ST_CHECK_ARG(!fitting_, "Trainer::Fit is already running");
  try {
    RunFit(module, train, val, ckpt_path);
  } catch (const std::exception& e) {
    // on_exception of the module, then of the callbacks; their own failures do not replace `e`.
    const auto call = [&](const char* who, const std::function<void()>& hook) {
      try {
        hook();
      } catch (const std::exception& inner) {
        ST_LOG(ERROR) << who << " on_exception threw (ignored): " << inner.what();
      }
    };
    call("TrainingModule", [&] { module.on_exception(e); });
    for (auto& cb : options_.callbacks) call("Callback", [&] { cb->on_exception(*this, module, e); });
    throw;
  }
}

void Trainer::RunFit(TrainingModule& module, const Dataset& train, const Dataset* val, const std::string& ckpt_path) {
  struct FittingScope {
    bool& flag;
    explicit FittingScope(bool& f) : flag(f) { flag = true; }
    ~FittingScope() { flag = false; }
  } fitting(fitting_);
  StopSignalScope stop_signals;  // before SetupProcesses: the launcher's forwarding chains to it
  SetupProcesses();
  const auto& o = options_;
  const int W = world_size();
  fit_train_batches_ = NumTrainingBatches(train, W);  // for estimated_stepping_batches() in configure_optimizers
  SetupModel(module);
  callback_metrics_.clear();
  should_stop_ = false;
  // Resume before the loggers make this run's version_N: a failed resume leaves no empty one.
  const std::string resume_from = ResolveCheckpointPath(ckpt_path);
  if (!resume_from.empty()) {
    LoadFrom(resume_from);
    sharding::ReleaseHostBlockCache();  // what the load read is not what the steps need
  }
  SetupLoggers(module);
  ProfilingScope profiling(*this);  // profiler="simple"/"pytorch" (trainer/profilers/profiler.h)
  step_losses_.clear();
  val_losses_.clear();
  const Dataset* val_set = internal::FitValidationSet(o, train, val);  // overfit_batches: the training set
  FitLoop loop{module, train, val_set, DistributedSampler(train.size(), W, rank(), o.shuffle, o.seed, /*drop_last=*/false),
               fit_train_batches_, 1, strategies::ParseGradClipAlgorithm(o.gradient_clip_algorithm)};
  loop.builtin_checkpoints = o.enable_checkpointing;
  loop.metrics = internal::MetricCollector(
      {world_.get(), rank(), W, [this](std::vector<double> v) { return AllReduceSum(std::move(v)); }});
  for (const auto& cb : o.callbacks) {
    if (dynamic_cast<ModelCheckpoint*>(cb.get())) loop.builtin_checkpoints = false;
  }
  ST_CHECK_ARG(loop.nb > 0, "no training batches: dataset of ", train.size(), " samples, ", W, " ranks, batch_size ",
               o.batch_size, ", limit_train_batches ", o.limit_train_batches);
  loop.val_every = o.val_check_interval > 1.0 ? static_cast<int64_t>(o.val_check_interval)
                                              : std::max<int64_t>(1, static_cast<int64_t>(std::floor(
                                                                         loop.nb * o.val_check_interval)));
  if (rank() == 0 && o.enable_progress_bar) {
    loop.progress = std::make_unique<ProgressReporter>(estimated_stepping_batches(), o.log_every_n_steps);
  }
  if (o.enable_model_summary && rank() == 0) {
    std::fputs(FormatModelSummary(SummarizeModel(*strategy_, optimizer())).c_str(), stdout);
    std::fflush(stdout);
  }
  module.on_fit_start();
  for (auto& cb : o.callbacks) cb->on_fit_start(*this, module);
  strategy_->module().train();
  loop.stop = o.max_steps >= 0 && global_step_ >= o.max_steps;
  internal::RunExplainingNondeterminism(o.deterministic, [&] {
    if (loop.val) RunSanityCheck(module, *loop.val);
    while (!loop.stop && (max_epochs_ < 0 || epoch_ < max_epochs_)) RunEpoch(loop);
  });
  FinishFit(loop);
}

// "" (start afresh), the given path, or for "last" (and resume="auto" without
// a path) the newest complete checkpoint: rank 0 decides, every rank uses it.
// Also removes what killed saves of earlier runs left behind.
std::string Trainer::ResolveCheckpointPath(const std::string& ckpt_path) {
  const auto& o = options_;
  const bool find = ckpt_path == "last" || (ckpt_path.empty() && o.resume == "auto");
  // "best": ModelCheckpoint's best (trainer/loops/run_controls.h), the same on every rank.
  std::string path = ckpt_path == "best" ? BestCheckpointPath(o.callbacks) : ckpt_path;
  if (rank() == 0) {
    for (const auto& r : RemoveCheckpointLitter(o.default_root_dir, o.logger_name)) {
      ST_LOG(INFO) << "removed " << r << " (left by a save that was killed)";
    }
    if (find) path = FindLatestCheckpoint(o.default_root_dir, o.logger_name);
  }
  if (!find) return path;
  path = BroadcastString(path);
  if (path.empty()) {
    ST_CHECK_ARG(ckpt_path != "last", "ckpt_path=\"last\": no complete checkpoint under '", o.default_root_dir,
                 "' (looked in ", (fs::path(o.default_root_dir) / o.logger_name / "version_N" / "checkpoints").string(),
                 " and ", (fs::path(o.default_root_dir) / "checkpoints").string(),
                 "); run once without it first, or pass a checkpoint path");
    if (rank() == 0) ST_LOG(INFO) << "resume=auto: no checkpoint under " << o.default_root_dir << "; starting afresh";
  }
  return path;
}

void Trainer::RunEpoch(FitLoop& loop) {
  const auto& o = options_;
  TrainingModule& module = loop.module;
  loop.sampler.set_epoch(epoch_);
  module.epoch_ = epoch_;
  if (batch_in_epoch_ == 0) {
    module.on_train_epoch_start(epoch_);
    for (auto& cb : o.callbacks) cb->on_train_epoch_start(*this, module, epoch_);
  }
  loop.acc_loss = 0;
  loop.acc_n = 0;
  // Prepared ahead by num_workers threads (in this order), from batch_in_epoch_ (a resumed epoch) on.
  DataLoader loader(loop.train, MakeBatches(loop.sampler.indices(), o.batch_size, o.drop_last), LoaderOptions(),
                    std::min(batch_in_epoch_, loop.nb), loop.nb);
  for (int64_t i = batch_in_epoch_; i < loop.nb; ++i) {
    const bool sync = (i + 1) % o.accumulate_grad_batches == 0 || i + 1 == loop.nb;
    if (i % o.accumulate_grad_batches == 0) {
      loop.stop_before_step = should_stop_;
      if (world_size() > 1) loop.rng_at_step_start = at::detail::getDefaultCPUGenerator().get_state();
    }
    auto fetch = Profile(kActionGetTrainBatch);
    Batch next = loader.Next();
    fetch.Stop();
    const at::Tensor loss = TrainStep(loop, std::move(next), i);
    if (sync) {
      // 16-mixed: the overflow flag joins the step's one collective (Unscale's reduce callback);
      // so does the non-finite check's flag (trainer/loops/nonfinite.h; 0 when off).
      const double bad =
          nonfinite_.enabled() ? nonfinite_.LocalFlag(loop.acc_loss / loop.acc_n, strategy_->named_parameters()) : 0;
      double slot = 0;
      const auto sync_step = [&](double overflow) { return slot = SyncStep(loop, (overflow > 0) + bad); };
      bool skip = scaler_ ? scaler_->Unscale(strategy_->parameters(), sync_step) : sync_step(0) > 0;
      if (loop.discard) {
        DiscardStep(loop);
        break;
      }
      skip = nonfinite_.Decide(slot, global_step_, rank()) || skip;
      OptimizerStep(loop, skip);
      OnStepEnd(loop);
    }
    // A stop requested here reaches the other ranks in the next collective:
    // after validation or at the epoch end (SyncShouldStop), else with the
    // next step's (SyncStep), which then discards that step.
    auto hooks = Profile(kActionCallbacksOnTrainBatchEnd);
    for (auto& cb : o.callbacks) cb->on_train_batch_end(*this, module, loss, i);
    hooks.Stop();
    if (sync && should_stop_ && world_size() == 1) loop.stop = true;  // nobody to tell
    if (loop.val && (i + 1) % loop.val_every == 0 && internal::ValidatesInEpoch(o, epoch_)) {
      RunValidation(module, *loop.val);
      SyncShouldStop();
      if (should_stop_ && sync) loop.stop = true;
    }
    if (loop.stop) break;
  }
  if (batch_in_epoch_ >= loop.nb) OnEpochEnd(loop);
}

// training_step and backward of one micro-batch; returns its (detached) loss.
at::Tensor Trainer::TrainStep(FitLoop& loop, Batch batch, int64_t i) {
  const auto& o = options_;
  const bool sync = (i + 1) % o.accumulate_grad_batches == 0 || i + 1 == loop.nb;
  Batch b = ToDevice(std::move(batch));
  TrainingModule& module = loop.module;
  module.on_train_batch_start(b, i);
  for (auto& cb : o.callbacks) cb->on_train_batch_start(*this, module, b, i);
  auto forward = Profile(kActionTrainingStep);
  at::Tensor loss = module.training_step(b, i);
  forward.Stop();
  if (sync_bn_) sync_bn_->CheckNotBypassed();  // once: the model reached the SyncBatchNorm layers
  at::Tensor to_backward = o.accumulate_grad_batches > 1 ? loss / static_cast<double>(o.accumulate_grad_batches) : loss;
  module.on_before_backward(to_backward);
  for (auto& cb : o.callbacks) cb->on_before_backward(*this, module, to_backward);
  if (scaler_) to_backward = scaler_->Scale(to_backward);
  auto backward = Profile(kActionBackward);
  strategy_->Backward(to_backward, sync);
  backward.Stop();
  module.on_after_backward();
  for (auto& cb : o.callbacks) cb->on_after_backward(*this, module);
  auto hook = Profile(kActionOnTrainBatchEnd);
  module.on_train_batch_end(loss.detach(), i);
  hook.Stop();
  loop.metrics.AddBatch(module);
  loop.acc_loss += loss.detach().to(at::kDouble).item<double>();
  ++loop.acc_n;
  batch_in_epoch_ = i + 1;
  return loss.detach();
}

// The step's one collective: [loss, overflow, stop before the step, stop,
// SIGTERM, SIGINT, SIGUSR1] and what the module Log()ged in the step
// (trainer/connectors/internal/metric_log.h) summed over the ranks. Sets the agreed loss,
// metrics, stop flags and stop signal in `loop`; returns the overflow slot's
// sum (> 0: some rank overflowed or found a non-finite value, trainer/loops/nonfinite.h).
double Trainer::SyncStep(FitLoop& loop, double overflow) {
  constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1};
  const int received = ReceivedStopSignal();
  std::vector<double> v = {loop.acc_loss / static_cast<double>(loop.acc_n), overflow,
                           loop.stop_before_step ? 1.0 : 0.0, should_stop_ ? 1.0 : 0.0};
  for (int sig : kSignals) v.push_back(received == sig ? 1.0 : 0.0);
  v = loop.metrics.SyncStep(std::move(v));
  const double W = world_size();
  loop.step_loss = v[0] / W;
  loop.discard = v[2] > 0;
  if (v[3] > 0) {  // requested before this step's collective: Fit ends after this step
    should_stop_ = true;
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
void Trainer::DiscardStep(FitLoop& loop) {
  opt_.optimizer->zero_grad();
  if (loop.rng_at_step_start.defined()) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    gen.set_state(loop.rng_at_step_start);
  }
  batch_in_epoch_ -= loop.acc_n;
  loop.acc_loss = 0;
  loop.acc_n = 0;
  loop.stop = true;
}

// Clipping, optimizer.step (unless the 16-mixed scaler found an overflow on
// any rank), the scaler's update and zero_grad. (The LR schedulers step in
// OnStepEnd.)
void Trainer::OptimizerStep(FitLoop& loop, bool skip) {
  auto profiled = Profile(kActionOptimizerStep);
  const auto& o = options_;
  loop.module.on_before_optimizer_step(*opt_.optimizer);
  for (auto& cb : o.callbacks) cb->on_before_optimizer_step(*this, loop.module, *opt_.optimizer);
  if (!skip && o.gradient_clip_val > 0) strategy_->ClipGradients(o.gradient_clip_val, loop.clip_algo);
  if (!skip) opt_.optimizer->step();
  if (scaler_) scaler_->Update(skip);
  opt_.optimizer->zero_grad();
}

// After an optimizer step: count it, publish and log the agreed loss and
// metrics, report progress, write the periodic checkpoint, decide to stop.
void Trainer::OnStepEnd(FitLoop& loop) {
  const auto& o = options_;
  ++global_step_;
  loop.module.global_step_ = global_step_;
  const double l = loop.step_loss;
  loop.acc_loss = 0;
  loop.acc_n = 0;
  step_losses_.push_back(l);
  std::map<std::string, double> row = loop.step_metrics;
  for (const auto& [k, v] : row) callback_metrics_[k] = v;
  callback_metrics_["train_loss"] = l;
  if (!loggers_.empty() && global_step_ % o.log_every_n_steps == 0) {
    row["train_loss"] = l;
    row["epoch"] = static_cast<double>(epoch_);
    row["lr"] = opt_.optimizer->param_groups()[0].options().get_lr();
    if (scaler_) row["grad_scale"] = scaler_->scale();
    LogMetrics(row, global_step_);
  }
  if (loop.progress) loop.progress->Update(epoch_, global_step_, l, loop.metrics.prog_bar());
  StepLRSchedulers("step", global_step_);  // interval "step" (trainer/loops/lr_stepping.cc)
  if (loop.builtin_checkpoints && o.checkpoint_every_n_steps > 0 && global_step_ % o.checkpoint_every_n_steps == 0) {
    loop.saved_path = (fs::path(ckpt_dir_) / ("step=" + std::to_string(global_step_) + ".ckpt")).string();
    SaveCheckpoint(loop.saved_path);
    loop.saved_at = {global_step_, epoch_, batch_in_epoch_};
  }
  if (o.max_steps >= 0 && global_step_ >= o.max_steps) loop.stop = true;
  if (loop.stop_signal != 0) loop.stop = true;
}

void Trainer::OnEpochEnd(FitLoop& loop) {
  // The epoch aggregates of what the module Log()ged with on_epoch (one
  // all-reduce, only when there are any), before the epoch-end hooks see them.
  if (loop.metrics.has_epoch_values()) {
    std::map<std::string, double> row = loop.metrics.ReduceEpoch("training", /*names_agreed=*/true);
    for (const auto& [k, v] : row) callback_metrics_[k] = v;
    row["epoch"] = static_cast<double>(epoch_);
    LogMetrics(row, global_step_);
  }
  auto hooks = Profile(kActionOnTrainEpochEnd);
  loop.module.on_train_epoch_end(epoch_);
  const int64_t finished = epoch_;
  ++epoch_;
  batch_in_epoch_ = 0;
  StepLRSchedulers("epoch", epoch_);  // interval "epoch", after the epoch's validation
  for (auto& cb : options_.callbacks) cb->on_train_epoch_end(*this, loop.module, finished);
  hooks.Stop();
  SyncShouldStop();
  if (should_stop_) loop.stop = true;
  if (loop.builtin_checkpoints) SaveLast(loop);
}

// <checkpoint_dir>/last.ckpt for the current state. When this Fit's last
// checkpoint already holds it: nothing (it was last.ckpt) or a hard link to
// that full checkpoint file (step=N.ckpt at the final step: one copy on disk).
std::string Trainer::SaveLast(FitLoop& loop) {
  const std::string last = (fs::path(ckpt_dir_) / "last.ckpt").string();
  const std::tuple<int64_t, int64_t, int64_t> now{global_step_, epoch_, batch_in_epoch_};
  if (loop.saved_at == now && loop.saved_path == last) return last;
  if (loop.saved_at == now) {
    const bool linked = rank() == 0 && LinkFileAtomically(loop.saved_path, last);
    if (AllReduceSum({linked ? 1.0 : 0.0})[0] > 0) {
      last_ckpt_ = last;
      loop.saved_path = last;
      return last;
    }
  }
  SaveCheckpoint(last);
  loop.saved_at = now;
  loop.saved_path = last;
  return last;
}

void Trainer::FinishFit(FitLoop& loop) {
  // The steps' freed host blocks were kept for the next step: there is none.
  sharding::ReleaseHostBlockCache();
  std::string saved;
  if (loop.stop_signal != 0 && options_.enable_checkpointing) {
    saved = SaveLast(loop);
  } else if (loop.builtin_checkpoints) {
    SaveLast(loop);
  }
  if (loop.progress) loop.progress->Finish();
  for (auto& l : loggers_) l->Save();
  if (profiler_) profiler_->Report();
  if (loop.stop_signal != 0) {
    const int sig = loop.stop_signal;
    std::ostringstream msg;
    msg << "stopped by " << StopSignalName(sig) << " after global step " << global_step_ << " (epoch " << epoch_
        << "); " << (saved.empty() ? std::string("checkpointing is off: nothing saved") : "saved " + saved)
        << "; resume with ckpt_path=\"last\" (--ckpt_path=last) or resume=\"auto\" (--resume=auto); exit status "
        << StopExitCode(sig);
    if (rank() == 0) ST_LOG(WARNING) << msg.str();
    throw Preempted(sig, saved, msg.str());
  }
  loop.module.on_fit_end();
  for (auto& cb : options_.callbacks) cb->on_fit_end(*this, loop.module);
}

std::vector<double> Trainer::AllReduceSum(std::vector<double> values) {
  if (world_size() == 1 || values.empty()) return values;
  const bool nccl = world_->backend() == "nccl";
  at::Tensor t = at::tensor(values, at::kDouble);
  if (nccl) t = t.to(c10::Device(c10::kCUDA));  // NCCL takes CUDA tensors only
  world_->AllReduce(t, {comm::ReduceOp::kSum})->Wait();
  t = t.cpu();
  std::memcpy(values.data(), t.data_ptr<double>(), values.size() * sizeof(double));
  return values;
}

// Rank 0's `s` on every rank.
std::string Trainer::BroadcastString(const std::string& s) {
  if (world_size() == 1) return s;
  at::Tensor len = at::full({1}, static_cast<int64_t>(s.size()), at::kLong);
  strategy_->Broadcast(len, 0);
  at::Tensor buf = at::zeros({len.item<int64_t>()}, at::kByte);
  if (rank() == 0 && !s.empty()) std::memcpy(buf.data_ptr<uint8_t>(), s.data(), s.size());
  strategy_->Broadcast(buf, 0);
  return std::string(reinterpret_cast<const char*>(buf.data_ptr<uint8_t>()), buf.numel());
}

}  // namespace shardtrain::trainer
