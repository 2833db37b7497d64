#include "trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>

#include "base/errors.h"
#include "base/logging.h"
#include "comm/gloo_communicator.h"
#include "comm/peer_watch.h"
#include "comm/rendezvous.h"
#include "launch/cluster_environment.h"
#include "launch/cluster_rendezvous.h"
#include "launch/launcher.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_state.h"
#include "trainer/csv_logger.h"
#include "trainer/metric_log.h"
#include "trainer/optimizer_ownership.h"
#include "trainer/progress.h"
#include "trainer/resume.h"
#include "trainer/run_controls.h"
#include "trainer/tensorboard_logger.h"

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

Trainer::Trainer(TrainerOptions options, comm::CommunicatorPtr world)
    : options_(internal::ApplyRunControls(std::move(options))), world_(std::move(world)) {
  const auto& o = options_;
  accelerator_ = ResolveAccelerator(o.accelerator);
  ST_CHECK_ARG((o.devices >= 1 || o.devices == kAutoDevices) && o.num_nodes >= 1,
               "devices must be >= 1 or kAutoDevices (\"auto\") and num_nodes >= 1, got devices=", o.devices,
               ", num_nodes=", o.num_nodes);
  devices_ = ResolveDevices(o.devices, accelerator_);
  precision_ = strategies::ParsePrecision(o.precision);
  GradScaler check_scaler_options(o.grad_scaler);
  strategies::ParseGradClipAlgorithm(o.gradient_clip_algorithm);
  ST_CHECK_ARG(o.gradient_clip_val >= 0, "gradient_clip_val must be >= 0, got ", o.gradient_clip_val);
  ST_CHECK_ARG(!o.max_epochs || *o.max_epochs >= -1, "max_epochs must be >= 0, -1 (unlimited) or unset, got ",
               *o.max_epochs);
  ST_CHECK_ARG(o.max_steps >= -1, "max_steps must be >= 0 or -1 (no limit), got ", o.max_steps);
  // Lightning's rule for an unset max_epochs: 1000 without max_steps, unlimited with it.
  max_epochs_ = o.max_epochs ? *o.max_epochs : (o.max_steps == -1 ? kDefaultMaxEpochs : -1);
  ST_CHECK_ARG(max_epochs_ >= 0 || o.max_steps >= 0, "max_epochs=-1 (unlimited) needs max_steps");
  ST_CHECK_ARG(o.accumulate_grad_batches >= 1, "accumulate_grad_batches must be >= 1, got ",
               o.accumulate_grad_batches);
  ST_CHECK_ARG(o.val_check_interval > 0, "val_check_interval must be > 0, got ", o.val_check_interval);
  ST_CHECK_ARG(o.limit_train_batches >= 0 && o.limit_val_batches >= 0, "limit_*_batches must be >= 0");
  ST_CHECK_ARG(o.batch_size >= 1 && o.val_batch_size >= 0, "batch_size must be >= 1, got ", o.batch_size);
  ST_CHECK_ARG(o.log_every_n_steps >= 1, "log_every_n_steps must be >= 1, got ", o.log_every_n_steps);
  CheckDataLoaderOptions(LoaderOptions());  // num_workers, prefetch_factor
  for (const auto& l : o.loggers) {
    ST_CHECK_ARG(l == "csv" || l == "tensorboard", "unknown logger '", l, "'; valid: csv, tensorboard");
  }
  for (const auto& cb : o.callbacks) ST_CHECK_ARG(cb != nullptr, "TrainerOptions::callbacks holds a null callback");
  const auto& resume_modes = ResumeModes();
  ST_CHECK_ARG(std::find(resume_modes.begin(), resume_modes.end(), o.resume) != resume_modes.end(),
               "resume must be \"never\" or \"auto\", got \"", o.resume, "\"");
  ST_CHECK_ARG(o.timeout.count() > 0, "timeout must be > 0 ms, got ", o.timeout.count(), " ms");
  comm::CheckStallOptions(o.stall_warning, o.stall_timeout, "TrainerOptions");
  CheckProfilerOptions(o.profiler, o.profiler_steps);
  nonfinite_ = NonfiniteCheck(o.nonfinite, precision_ != strategies::Precision::k16Mixed);  // checks the option
  if (o.strategy_object) {
    strategy_ = o.strategy_object;
  } else if (o.strategy != "auto") {
    strategy_ = strategies::StrategyRegistry::Create(o.strategy, o.strategy_options);  // fails early on bad options
  } else {
    ST_CHECK_ARG(o.strategy_options.empty(), "strategy 'auto' takes no options; name the strategy");
  }
  if (strategy_ && !strategy_->wrapped()) {
    strategy_->SetPrecision(o.precision);  // a precision it rejects: now
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
std::string Trainer::log_dir() const { return loggers_.empty() ? "" : loggers_.front()->log_dir(); }

void Trainer::LogMetrics(const std::map<std::string, double>& metrics, int64_t step) {
  for (auto& l : loggers_) {
    l->LogMetrics(metrics, step);
    l->Save();
  }
}

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

void Trainer::SetupProcesses() {
  if (world_) return;
  const int W = devices_ * options_.num_nodes;
  const bool cuda = accelerator_ == "cuda";
  if (W == 1) {
    if (cuda) {
      SetCurrentDevice(RankDevice(accelerator_, 0));
      world_ = CreateNcclCommunicator(comm::CreateHashStore(), 0, 1, 0, CommLimits{options_.timeout});
      return;
    }
    comm::GlooOptions go;
    go.hostname = "127.0.0.1";
    go.timeout = options_.timeout;
    world_ = comm::GlooCommunicator::Create(comm::CreateHashStore(), 0, 1, go);
    return;
  }
  ClusterInfo info = DetectClusterEnvironment();
  if (info.source == "single" && std::getenv(kLaunchedEnvVar) == nullptr) {
    ST_CHECK_ARG(options_.num_nodes == 1, "num_nodes=", options_.num_nodes,
                 " needs an external launcher (torchrun, srun, mpirun); none was detected");
    LaunchOptions lo;
    lo.num_ranks = devices_;
    LaunchLocalRanks(lo);
    info = DetectClusterEnvironment();
  }
  // The launcher gives the ranks it starts OMP_NUM_THREADS (cores split
  // between local ranks); this process's OpenMP read the environment before.
  if (const char* t = std::getenv("OMP_NUM_THREADS")) at::set_num_threads(std::max(1, std::atoi(t)));
  ST_CHECK_ARG(info.world_size == W, "the job has ", info.world_size, " ranks (", info.source,
               ") but devices * num_nodes = ", W);
  SetLogRank(info.rank, info.world_size);
  comm::RendezvousOptions ro = RendezvousOptionsFor(info);
  ro.timeout = options_.timeout;
  cluster_ = info;
  if (cuda) {
    SetCurrentDevice(RankDevice(accelerator_, info.local_rank));
    world_ = CreateNcclCommunicator(comm::CreateStore(ro), info.rank, info.world_size, info.local_rank,
                                    CommLimits{options_.timeout, options_.stall_warning, options_.stall_timeout});
  } else {
    comm::GlooOptions go;
    go.timeout = options_.timeout;
    go.stall_warning = options_.stall_warning;
    go.stall_timeout = options_.stall_timeout;
    world_ = comm::GlooCommunicator::Create(comm::CreateStore(ro), info.rank, info.world_size, go);
  }
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
  if (options_.sync_batchnorm) {  // trainer/sync_batchnorm.h
    sync_bn_ = std::make_unique<SyncBatchNormConversion>(ConvertSyncBatchNorm(*model, world_));
  }
  if (device_.is_cuda()) model->to(device_);
  strategy_->WrapModel(model);
  opt_ = module.configure_optimizers(strategy_->parameters());
  ST_CHECK_ARG(opt_.optimizer != nullptr, "configure_optimizers returned no optimizer");
  internal::CheckOptimizerOwnsParameters(*opt_.optimizer, strategy_->parameters(), strategy_->name());
  initial_lrs_.clear();
  for (auto& g : opt_.optimizer->param_groups()) initial_lrs_.push_back(g.options().get_lr());
  SetupLRSchedulers();  // trainer/lr_scheduler_steps.cc
}

Batch Trainer::ToDevice(Batch b) const {
  if (!device_.is_cpu()) {
    if (b.inputs.defined()) b.inputs = b.inputs.to(device_);
    if (b.targets.defined()) b.targets = b.targets.to(device_);
    for (auto& kv : b.fields) {  // batches of any structure move as a whole
      if (kv.second.defined()) kv.second = kv.second.to(device_);
    }
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
  const int W = world_ ? world_->size() : devices_ * o.num_nodes;
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

int64_t Trainer::LimitBatches(double limit, int64_t available) const {
  if (options_.fast_dev_run > 0) return std::min<int64_t>(available, options_.fast_dev_run);
  if (limit > 1.0) return std::min<int64_t>(available, static_cast<int64_t>(limit));
  return static_cast<int64_t>(std::floor(available * limit));
}

void Trainer::SyncShouldStop() {
  if (options_.callbacks.empty()) return;
  should_stop_ = strategy_->ReduceMax(should_stop_ ? 1.0 : 0.0) > 0;
}

// RunValidation: trainer/eval_loop.cc (the evaluation loop it shares with Test and Predict).

void Trainer::SetupLoggers(TrainingModule& module) {
  if (loggers_set_up_) return;
  const auto& o = options_;
  loggers_.clear();
  if (rank() == 0 && o.enable_logger) {
    int version = -1;
    for (const auto& name : o.loggers) {
      if (name == "csv") {
        auto l = std::make_shared<CsvLogger>(o.default_root_dir, o.logger_name, version);
        version = l->version();
        loggers_.push_back(l);
      } else if (name == "tensorboard") {
        auto l = std::make_shared<TensorBoardLogger>(o.default_root_dir, o.logger_name, version);
        version = l->version();
        loggers_.push_back(l);
      }
    }
    for (const auto& l : o.logger_objects) {
      if (l) loggers_.push_back(l);
    }
    auto hp = module.hparams();
    hp.emplace("strategy", strategy_->name());
    hp.emplace("precision", o.precision);
    hp.emplace("accelerator", accelerator_);
    hp.emplace("world_size", std::to_string(world_size()));
    hp.emplace("batch_size", std::to_string(o.batch_size));
    hp.emplace("accumulate_grad_batches", std::to_string(o.accumulate_grad_batches));
    hp.emplace("seed", std::to_string(o.seed));
    for (auto& l : loggers_) l->LogHyperparams(hp);
  }
  // Every rank must agree on the directory: rank 0 has the loggers.
  const std::string root = BroadcastString(loggers_.empty() ? o.default_root_dir : loggers_.front()->log_dir());
  ckpt_dir_ = (fs::path(root) / "checkpoints").string();
  loggers_set_up_ = true;
}

double Trainer::Validate(TrainingModule& module, const Dataset& val) {
  SetupProcesses();
  SetupModel(module);
  SetupLoggers(module);
  ST_CHECK_ARG(!fitting_, "Trainer::Validate cannot run inside Fit");
  return RunValidation(module, val);
}

}  // namespace shardtrain::trainer
