#include "trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>

#include "base/errors.h"
#include "base/logging.h"
#include "base/names.h"
#include "comm/peer_watch.h"
#include "launch/cluster_environment.h"
#include "sharding/sharded_init.h"
#include "trainer/checkpoint_io/resume.h"
#include "trainer/connectors/internal/checkpoint_connector.h"
#include "trainer/connectors/internal/checkpoint_state.h"
#include "trainer/connectors/internal/data_connector.h"
#include "trainer/connectors/internal/logger_connector.h"
#include "trainer/connectors/internal/optimizer_ownership.h"
#include "trainer/connectors/internal/process_connector.h"
#include "trainer/connectors/internal/profiling_connector.h"
#include "trainer/loops/internal/eval_loop.h"
#include "trainer/loops/internal/fit_loop.h"
#include "trainer/loops/internal/lr_stepping.h"
#include "trainer/loops/run_controls.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

strategies::Strategy& TrainingModule::strategy() {
  ST_CHECK_ARG(strategy_ != nullptr, "TrainingModule: no strategy yet (only valid inside Trainer::Fit/Validate)");
  return *strategy_;
}

Trainer& TrainingModule::trainer() {
  ST_CHECK_ARG(trainer_ != nullptr, "TrainingModule: no trainer yet (only valid inside Trainer::Fit/Validate)");
  return *trainer_;
}

namespace {

// What checking options (with the run controls applied) resolves, for the
// Trainer to keep: it checks and resolves once.
struct ResolvedOptions {
  std::string accelerator;  // "cpu" or "cuda"
  int devices = 1;
  strategies::Precision precision = strategies::Precision::k32True;
  int64_t max_epochs = kDefaultMaxEpochs;
  NonfiniteCheck nonfinite;
  strategies::StrategyPtr strategy;  // made from the name (precision set); null for "auto" or a strategy_object
};

// The checks of the Trainer's constructor and of CheckTrainerOptions.
ResolvedOptions ResolveOptions(const TrainerOptions& o) {
  ResolvedOptions r;
  r.accelerator = ResolveAccelerator(o.accelerator);
  ST_CHECK_ARG((o.devices >= 1 || o.devices == kAutoDevices) && o.num_nodes >= 1,
               "devices must be >= 1 or kAutoDevices (\"auto\") and num_nodes >= 1, got devices=", o.devices,
               ", num_nodes=", o.num_nodes);
  r.devices = ResolveDevices(o.devices, r.accelerator);
  r.precision = strategies::ParsePrecision(o.precision);
  GradScaler check_scaler_options(o.grad_scaler);
  strategies::ParseGradClipAlgorithm(o.gradient_clip_algorithm);
  ST_CHECK_ARG(o.gradient_clip_val >= 0, "gradient_clip_val must be >= 0, got ", o.gradient_clip_val);
  ST_CHECK_ARG(!o.max_epochs || *o.max_epochs >= -1, "max_epochs must be >= 0, -1 (unlimited) or unset, got ",
               *o.max_epochs);
  ST_CHECK_ARG(o.max_steps >= -1, "max_steps must be >= 0 or -1 (no limit), got ", o.max_steps);
  // Lightning's rule for an unset max_epochs: 1000 without max_steps, unlimited with it.
  r.max_epochs = o.max_epochs ? *o.max_epochs : (o.max_steps == -1 ? kDefaultMaxEpochs : -1);
  ST_CHECK_ARG(r.max_epochs >= 0 || o.max_steps >= 0, "max_epochs=-1 (unlimited) needs max_steps");
  ST_CHECK_ARG(o.async_checkpoint_max_extra_memory >= 0 && o.async_checkpoint_max_extra_memory <= 1,
               "async_checkpoint_max_extra_memory must be in [0, 1] (a fraction of what a rank writes), got ",
               o.async_checkpoint_max_extra_memory);
  ST_CHECK_ARG(o.accumulate_grad_batches >= 1, "accumulate_grad_batches must be >= 1, got ",
               o.accumulate_grad_batches);
  ST_CHECK_ARG(o.val_check_interval > 0, "val_check_interval must be > 0, got ", o.val_check_interval);
  ST_CHECK_ARG(o.limit_train_batches >= 0 && o.limit_val_batches >= 0, "limit_*_batches must be >= 0");
  ST_CHECK_ARG(o.batch_size >= 1 && o.val_batch_size >= 0, "batch_size must be >= 1, got ", o.batch_size);
  ST_CHECK_ARG(o.log_every_n_steps >= 1, "log_every_n_steps must be >= 1, got ", o.log_every_n_steps);
  DataLoaderOptions loader;
  loader.num_workers = o.num_workers;
  loader.prefetch_factor = o.prefetch_factor;
  CheckDataLoaderOptions(loader);
  for (const auto& l : o.loggers) {
    ST_CHECK_ARG(l == "csv" || l == "tensorboard", "unknown logger '", l, "'; valid: csv, tensorboard");
  }
  for (const auto& cb : o.callbacks) ST_CHECK_ARG(cb != nullptr, "TrainerOptions::callbacks holds a null callback");
  const auto& resume_modes = ResumeModes();
  ST_CHECK_ARG(std::find(resume_modes.begin(), resume_modes.end(), o.resume) != resume_modes.end(),
               "resume must be one of ", JoinNames(resume_modes, resume_modes.size(), "\""), ", got \"", o.resume, "\"");
  ST_CHECK_ARG(o.timeout.count() > 0, "timeout must be > 0 ms, got ", o.timeout.count(), " ms");
  comm::CheckStallOptions(o.stall_warning, o.stall_timeout, "TrainerOptions");
  CheckProfilerOptions(o.profiler, o.profiler_steps);
  r.nonfinite = NonfiniteCheck(o.nonfinite, r.precision != strategies::Precision::k16Mixed);  // checks the option
  if (!o.strategy_object && o.strategy != "auto") {
    r.strategy = strategies::StrategyRegistry::Create(o.strategy, o.strategy_options);  // fails early on bad options
    r.strategy->SetPrecision(o.precision);  // a precision it rejects: now
  }
  ST_CHECK_ARG(o.strategy_object || o.strategy != "auto" || o.strategy_options.empty(),
               "strategy 'auto' takes no options; name the strategy");
  return r;
}

}  // namespace

void CheckTrainerOptions(const TrainerOptions& options) { ResolveOptions(internal::ApplyRunControls(options)); }

Trainer::Trainer(TrainerOptions options, comm::CommunicatorPtr world)
    : process_connector_(std::make_unique<internal::ProcessConnector>(*this)),
      logger_connector_(std::make_unique<internal::LoggerConnector>(*this)),
      checkpoint_connector_(std::make_unique<internal::CheckpointConnector>(*this)),
      data_connector_(std::make_unique<internal::DataConnector>(*this)),
      profiling_connector_(std::make_unique<internal::ProfilingConnector>(*this)),
      lr_stepping_(std::make_unique<internal::LRStepping>(*this)),
      fit_loop_(std::make_unique<internal::FitLoop>(*this)),
      eval_loop_(std::make_unique<internal::EvalLoop>(*this)),
      options_(internal::ApplyRunControls(std::move(options))),
      world_(std::move(world)) {
  const auto& o = options_;
  ResolvedOptions r = ResolveOptions(o);
  accelerator_ = std::move(r.accelerator);
  devices_ = r.devices;
  precision_ = r.precision;
  max_epochs_ = r.max_epochs;
  nonfinite_ = std::move(r.nonfinite);
  strategy_ = o.strategy_object ? o.strategy_object : std::move(r.strategy);
  if (strategy_ && !strategy_->wrapped()) {
    if (o.strategy_object) strategy_->SetPrecision(o.precision);  // a precision it rejects: now (named: checked)
    if (o.sharded_construction) strategy_->set_sharded_construction(*o.sharded_construction);  // as early
  }
}

Trainer::~Trainer() = default;

strategies::Strategy& Trainer::strategy() {
  ST_CHECK_ARG(strategy_ != nullptr, "Trainer: no strategy yet (before Fit with strategy 'auto')");
  return *strategy_;
}

int Trainer::rank() const { return world_ ? world_->rank() : 0; }
int Trainer::world_size() const { return world_ ? world_->size() : 1; }
int Trainer::data_parallel_rank() const {
  return strategy_ && strategy_->set_up() ? strategy_->data_parallel_rank() : rank();
}
int Trainer::data_parallel_size() const {
  return strategy_ && strategy_->set_up() ? strategy_->data_parallel_size() : world_size();
}
std::string Trainer::log_dir() const { return loggers().empty() ? "" : loggers().front()->log_dir(); }

void Trainer::LogMetrics(const std::map<std::string, double>& metrics, int64_t step) {
  logger_connector_->LogMetrics(metrics, step);
}

const std::vector<std::shared_ptr<Logger>>& Trainer::loggers() const { return logger_connector_->loggers(); }
const Profiler* Trainer::profiler() const { return profiling_connector_->profiler(); }
ProfileScope Trainer::Profile(const char* action) { return profiling_connector_->Profile(action); }

const std::vector<LRSchedulerConfig>& Trainer::lr_scheduler_configs() const { return lr_stepping_->configs(); }
std::map<std::string, double> Trainer::learning_rate_stats(bool last_step) const {
  return lr_stepping_->Stats(last_step);
}

void Trainer::SaveCheckpoint(const std::string& path, CheckpointFormat format) {
  checkpoint_connector_->Save(path, format);
}

void Trainer::WhenCheckpointSaved(std::function<void()> fn) { checkpoint_connector_->WhenSaved(std::move(fn)); }

std::vector<double> Trainer::learning_rates() const {
  std::vector<double> out;
  if (!opt_.optimizer) return out;
  for (auto& g : opt_.optimizer->param_groups()) out.push_back(g.options().get_lr());
  return out;
}

std::string Trainer::optimizer_name() const {
  if (!opt_.optimizer) return "Optimizer";
  const std::string kind = internal::OptimizerKind(*opt_.optimizer);
  return kind.empty() ? "Optimizer" : kind;
}

void Trainer::SetupModel(TrainingModule& module) {
  if (module_ == &module && strategy_ && strategy_->wrapped()) return;
  ST_CHECK_ARG(module_ == nullptr, "this Trainer already set up another module; use one Trainer per module");
  if (!strategy_) {
    strategy_ = strategies::StrategyRegistry::Create(world_size() > 1 ? "ddp" : "single_device");
    if (options_.sharded_construction) strategy_->set_sharded_construction(*options_.sharded_construction);
  }
  internal::ApplyDeterminism(options_.deterministic);
  at::manual_seed(options_.seed);
  ClusterInfo cluster;
  if (cluster_) {
    cluster = *cluster_;
  } else {
    cluster.rank = rank();
    cluster.world_size = world_size();
    cluster.local_world_size = options_.num_nodes == 1 ? world_size() : devices_;
    cluster.local_rank = rank() % cluster.local_world_size;
    cluster.num_nodes = options_.num_nodes;
  }
  device_ = RankDevice(accelerator_, cluster.local_rank);
  SetCurrentDevice(device_);
  strategy_->SetPrecision(options_.precision);
  strategy_->Setup(world_, cluster);
  if (fit_train_set_ != nullptr) fit_train_batches_ = NumTrainingBatches(*fit_train_set_, data_parallel_size());
  module.strategy_ = strategy_.get();
  module.trainer_ = this;
  module_ = &module;
  scaler_.reset();
  if (precision_ == strategies::Precision::k16Mixed && options_.grad_scaler.enabled) {
    scaler_ = std::make_unique<GradScaler>(options_.grad_scaler);
  }
  strategy_->SetDevice(device_);
  std::shared_ptr<torch::nn::Module> model;
  {
    // A sharded strategy may build the model shard by shard (its construction scope).
    auto construction = strategy_->MakeConstructionScope();
    model = module.configure_model();
  }
  ST_CHECK_ARG(model != nullptr, "configure_model returned no module");
  if (options_.sync_batchnorm) {  // trainer/plugins/sync_batchnorm.h
    sync_bn_ = std::make_unique<SyncBatchNormConversion>(ConvertSyncBatchNorm(*model, world_));
  }
  // Shard by shard when it was built so (each wrap point's shard moves, never the whole model).
  if (device_.is_cuda()) sharding::ShardedInitScope::MoveToDevice(*model, device_);
  strategy_->WrapModel(model);
  module.on_model_wrapped();
  opt_ = module.configure_optimizers(strategy_->parameters());
  ST_CHECK_ARG(opt_.optimizer != nullptr, "configure_optimizers returned no optimizer");
  internal::CheckOptimizerOwnsParameters(*opt_.optimizer, strategy_->parameters(), strategy_->name());
  lr_stepping_->Setup();
}

Batch Trainer::ToDevice(Batch b) const {
  if (!device_.is_cpu()) {
    // Asynchronous from the loader's pinned batches (DataConnector::LoaderOptions);
    // a pageable source (a batch made elsewhere) copies synchronously as before.
    const auto move = [this](at::Tensor& t) {
      if (t.defined()) t = t.to(device_, /*non_blocking=*/true);
    };
    move(b.inputs);
    move(b.targets);
    for (auto& kv : b.fields) move(kv.second);  // batches of any structure move as a whole
  }
  const auto dt = strategy_->compute_dtype();
  if (dt != at::kFloat && b.inputs.defined() && at::isFloatingType(b.inputs.scalar_type())) b.inputs = b.inputs.to(dt);
  return b;
}

int64_t Trainer::NumTrainingBatches(const Dataset& train, int world_size) const {
  const auto& o = options_;
  DistributedSampler sampler(train.size(), world_size, 0, /*shuffle=*/false, o.seed, /*drop_last=*/false);
  const int64_t all = static_cast<int64_t>(MakeBatches(sampler.indices(), o.batch_size, o.drop_last).size());
  return trainer::LimitBatches(o, Stage::kFit, all);
}

int64_t Trainer::estimated_stepping_batches(const Dataset& train) const {
  const auto& o = options_;
  if (max_epochs_ < 0) return o.max_steps;
  const int W =
      strategy_ && strategy_->set_up() ? data_parallel_size() : (world_ ? world_->size() : devices_ * o.num_nodes);
  const int64_t nb = NumTrainingBatches(train, W);
  int64_t steps = (nb + o.accumulate_grad_batches - 1) / o.accumulate_grad_batches * std::max<int64_t>(max_epochs_, 1);
  if (o.max_steps >= 0) steps = std::min(steps, o.max_steps);
  return steps;
}

int64_t Trainer::estimated_stepping_batches() const {
  ST_CHECK_ARG(fit_train_batches_ >= 0,
               "estimated_stepping_batches() needs the training data: call it from Fit (configure_optimizers on) or "
               "after it, or pass the data set");
  const auto& o = options_;
  if (max_epochs_ < 0) return o.max_steps;
  int64_t steps = (fit_train_batches_ + o.accumulate_grad_batches - 1) / o.accumulate_grad_batches *
                  std::max<int64_t>(max_epochs_, 1);
  if (o.max_steps >= 0) steps = std::min(steps, o.max_steps);
  return steps;
}

void Trainer::SyncShouldStop() {
  if (options_.callbacks.empty()) return;
  should_stop_ = strategy_->ReduceMax(should_stop_ ? 1.0 : 0.0) > 0;
}

void Trainer::Fit(TrainingModule& module, const Dataset& train, const Dataset* val, const std::string& ckpt_path) {
  ST_CHECK_ARG(!fitting_, "Trainer::Fit is already running");
  try {
    fit_loop_->Run(module, train, val, ckpt_path);
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

double Trainer::Validate(TrainingModule& module, const Dataset& val) {
  process_connector_->SetupProcesses();
  SetupModel(module);
  logger_connector_->SetupLoggers(module);
  ST_CHECK_ARG(!fitting_, "Trainer::Validate cannot run inside Fit");
  return eval_loop_->RunValidation(module, val);
}

std::map<std::string, double> Trainer::Test(TrainingModule& module, const Dataset& test) {
  eval_loop_->SetupForEval(module, "Test", test);
  logger_connector_->SetupLoggers(module);
  return eval_loop_->RunEvalStage(module, test, internal::EvalLoop::EvalStage::kTest);
}

at::Tensor Trainer::Predict(TrainingModule& module, const Dataset& data, const PredictOptions& options) {
  eval_loop_->SetupForEval(module, "Predict", data);
  return eval_loop_->Predict(module, data, options);
}

}  // namespace shardtrain::trainer
