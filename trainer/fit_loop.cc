// Trainer::Fit and its steps (train step, the step's one collective,
// optimizer step, end of step, end of epoch, end of fit), in the order of
// Lightning's fit loop; split from trainer.cc.
#include <ATen/ATen.h>
#include <signal.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string_view>
#include <tuple>

#include "base/errors.h"
#include "base/logging.h"
#include "trainer/file_util.h"
#include "trainer/progress.h"
#include "trainer/resume.h"
#include "trainer/sharded_checkpoint.h"
#include "trainer/stop_signals.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

static_assert(std::string_view(kCompleteMarkerName) == std::string_view(kShardedCompleteMarker),
              "trainer/resume.h must recognize complete sharded checkpoints");

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
  // The state the last checkpoint written by this Fit holds (SaveLast links instead of writing it again).
  std::tuple<int64_t, int64_t, int64_t> saved_at{-1, -1, -1};
  std::string saved_path;
};

void Trainer::Fit(TrainingModule& module, const Dataset& train, const Dataset* val, const std::string& ckpt_path) {
  ST_CHECK_ARG(!fitting_, "Trainer::Fit is already running");
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
  if (!resume_from.empty()) LoadFrom(resume_from);
  SetupLoggers(module);
  step_losses_.clear();
  val_losses_.clear();
  FitLoop loop{module, train, val, DistributedSampler(train.size(), W, rank(), o.shuffle, o.seed, /*drop_last=*/false),
               fit_train_batches_, 1, strategies::ParseGradClipAlgorithm(o.gradient_clip_algorithm)};
  loop.builtin_checkpoints = o.enable_checkpointing;
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
  module.on_fit_start();
  for (auto& cb : o.callbacks) cb->on_fit_start(*this, module);
  strategy_->module().train();
  loop.stop = o.max_steps >= 0 && global_step_ >= o.max_steps;
  while (!loop.stop && (max_epochs_ < 0 || epoch_ < max_epochs_)) RunEpoch(loop);
  FinishFit(loop);
}

// "" (start afresh), the given path, or for "last" (and resume="auto" without
// a path) the newest complete checkpoint: rank 0 decides, every rank uses it.
// Also removes what killed saves of earlier runs left behind.
std::string Trainer::ResolveCheckpointPath(const std::string& ckpt_path) {
  const auto& o = options_;
  const bool find = ckpt_path == "last" || (ckpt_path.empty() && o.resume == "auto");
  std::string path = ckpt_path;
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
  const auto batches = MakeBatches(loop.sampler.indices(), o.batch_size, o.drop_last);
  module.epoch_ = epoch_;
  if (batch_in_epoch_ == 0) module.on_train_epoch_start(epoch_);
  loop.acc_loss = 0;
  loop.acc_n = 0;
  for (int64_t i = batch_in_epoch_; i < loop.nb; ++i) {
    const bool sync = (i + 1) % o.accumulate_grad_batches == 0 || i + 1 == loop.nb;
    const at::Tensor loss = TrainStep(loop, batches[i], i);
    if (sync) {
      // 16-mixed: the overflow flag joins the step's one collective (Unscale's reduce callback);
      // so does the non-finite check's flag (trainer/nonfinite.h; 0 when off).
      const double bad =
          nonfinite_.enabled() ? nonfinite_.LocalFlag(loop.acc_loss / loop.acc_n, strategy_->named_parameters()) : 0;
      double slot = 0;
      const auto sync_step = [&](double overflow) { return slot = SyncStep(loop, (overflow > 0) + bad); };
      bool skip = scaler_ ? scaler_->Unscale(strategy_->parameters(), sync_step) : sync_step(0) > 0;
      skip = nonfinite_.Decide(slot, global_step_, rank()) || skip;
      OptimizerStep(loop, skip);
      OnStepEnd(loop);
    }
    for (auto& cb : o.callbacks) cb->on_train_batch_end(*this, module, loss, i);
    if (sync) {
      SyncShouldStop();
      if (should_stop_) loop.stop = true;
    }
    if (loop.val && (i + 1) % loop.val_every == 0) {
      RunValidation(module, *loop.val);
      SyncShouldStop();
      if (should_stop_ && sync) loop.stop = true;
    }
    if (loop.stop) break;
  }
  if (batch_in_epoch_ >= loop.nb) OnEpochEnd(loop);
}

// training_step and backward of one micro-batch; returns its (detached) loss.
at::Tensor Trainer::TrainStep(FitLoop& loop, const std::vector<int64_t>& batch, int64_t i) {
  const auto& o = options_;
  const bool sync = (i + 1) % o.accumulate_grad_batches == 0 || i + 1 == loop.nb;
  Batch b = ToDevice(loop.train.get_batch(batch));
  at::Tensor loss = loop.module.training_step(b, i);
  at::Tensor to_backward = o.accumulate_grad_batches > 1 ? loss / static_cast<double>(o.accumulate_grad_batches) : loss;
  if (scaler_) to_backward = scaler_->Scale(to_backward);
  strategy_->Backward(to_backward, sync);
  loop.module.on_train_batch_end(loss.detach(), i);
  loop.acc_loss += loss.detach().to(at::kDouble).item<double>();
  ++loop.acc_n;
  batch_in_epoch_ = i + 1;
  return loss.detach();
}

// The step's one collective: [loss, overflow, should_stop, SIGTERM, SIGINT,
// SIGUSR1, logged metrics...] summed over the ranks. Sets the agreed loss,
// metrics and stop signal in `loop`; returns the overflow slot's sum (> 0:
// some rank overflowed or found a non-finite value, trainer/nonfinite.h).
double Trainer::SyncStep(FitLoop& loop, double overflow) {
  constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1};
  const int received = ReceivedStopSignal();
  std::vector<double> v = {loop.acc_loss / static_cast<double>(loop.acc_n), overflow,
                           should_stop_ ? 1.0 : 0.0};
  for (int sig : kSignals) v.push_back(received == sig ? 1.0 : 0.0);
  std::vector<std::string> names;  // the same on every rank (what training_step log()ged)
  for (const auto& [k, x] : loop.module.logged_) {
    names.push_back(k);
    v.push_back(x);
  }
  loop.module.logged_.clear();
  v = AllReduceSum(std::move(v));
  const double W = world_size();
  loop.step_loss = v[0] / W;
  if (v[2] > 0) should_stop_ = true;
  loop.stop_signal = 0;
  for (int s = 2; s >= 0; --s) {  // SIGUSR1, SIGINT, SIGTERM: the first wins where ranks got different ones
    if (v[3 + s] > 0) loop.stop_signal = kSignals[s];
  }
  loop.step_metrics.clear();
  for (size_t j = 0; j < names.size(); ++j) loop.step_metrics[names[j]] = v[6 + j] / W;
  return v[1];
}

// Clipping, the LR schedule, optimizer.step (unless the 16-mixed scaler found
// an overflow on any rank), the scaler's update and zero_grad.
void Trainer::OptimizerStep(FitLoop& loop, bool skip) {
  const auto& o = options_;
  if (!skip && o.gradient_clip_val > 0) strategy_->ClipGradients(o.gradient_clip_val, loop.clip_algo);
  if (opt_.lr_lambda) {
    const double f = opt_.lr_lambda(global_step_);
    auto& groups = opt_.optimizer->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(initial_lrs_[g] * f);
  }
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
  if (loop.progress) loop.progress->Update(epoch_, global_step_, l);
  if (loop.builtin_checkpoints && o.checkpoint_every_n_steps > 0 && global_step_ % o.checkpoint_every_n_steps == 0) {
    loop.saved_path = (fs::path(ckpt_dir_) / ("step=" + std::to_string(global_step_) + ".ckpt")).string();
    SaveCheckpoint(loop.saved_path);
    loop.saved_at = {global_step_, epoch_, batch_in_epoch_};
  }
  if (o.max_steps >= 0 && global_step_ >= o.max_steps) loop.stop = true;
  if (loop.stop_signal != 0) loop.stop = true;
}

void Trainer::OnEpochEnd(FitLoop& loop) {
  loop.module.on_train_epoch_end(epoch_);
  const int64_t finished = epoch_;
  ++epoch_;
  batch_in_epoch_ = 0;
  for (auto& cb : options_.callbacks) cb->on_train_epoch_end(*this, loop.module, finished);
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
  std::string saved;
  if (loop.stop_signal != 0 && options_.enable_checkpointing) {
    saved = SaveLast(loop);
  } else if (loop.builtin_checkpoints) {
    SaveLast(loop);
  }
  if (loop.progress) loop.progress->Finish();
  for (auto& l : loggers_) l->Save();
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
