#include "trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>

#include "comm/cluster_environment.h"
#include "comm/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/launcher.h"
#include "comm/logging.h"
#include "comm/rendezvous.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_state.h"
#include "trainer/csv_logger.h"
#include "trainer/optimizer_ownership.h"
#include "trainer/progress.h"
#include "trainer/sharded_checkpoint.h"
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
    : options_(std::move(options)), world_(std::move(world)) {
  const auto& o = options_;
  accelerator_ = ResolveAccelerator(o.accelerator);
  ST_CHECK_ARG((o.devices >= 1 || o.devices == kAutoDevices) && o.num_nodes >= 1,
               "devices must be >= 1 or kAutoDevices (\"auto\") and num_nodes >= 1, got devices=", o.devices,
               ", num_nodes=", o.num_nodes);
  devices_ = ResolveDevices(o.devices, accelerator_);
  strategies::CheckPrecision(o.precision);
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
  for (const auto& l : o.loggers) {
    ST_CHECK_ARG(l == "csv" || l == "tensorboard", "unknown logger '", l, "'; valid: csv, tensorboard");
  }
  for (const auto& cb : o.callbacks) ST_CHECK_ARG(cb != nullptr, "TrainerOptions::callbacks holds a null callback");
  if (o.strategy_object) {
    strategy_ = o.strategy_object;
  } else if (o.strategy != "auto") {
    strategy_ = strategies::StrategyRegistry::Create(o.strategy, o.strategy_options);  // fails early on bad options
  } else {
    ST_CHECK_ARG(o.strategy_options.empty(), "strategy 'auto' takes no options; name the strategy");
  }
  if (strategy_ && !strategy_->wrapped()) strategy_->SetPrecision(o.precision);  // a precision it rejects: now
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
      world_ = CreateNcclCommunicator(comm::CreateHashStore(), 0, 1, 0);
      return;
    }
    comm::GlooOptions go;
    go.hostname = "127.0.0.1";
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
  comm::RendezvousOptions ro;
  ro.kind = "tcp";
  ro.rank = info.rank;
  ro.world_size = info.world_size;
  ro.master_addr = info.master_addr;
  ro.master_port = info.master_port;
  ro.agent_store = info.agent_store;
  ro.restart_count = info.restart_count;
  cluster_ = info;
  if (cuda) {
    SetCurrentDevice(RankDevice(accelerator_, info.local_rank));
    world_ = CreateNcclCommunicator(comm::CreateStore(ro), info.rank, info.world_size, info.local_rank);
  } else {
    world_ = comm::GlooCommunicator::Create(comm::CreateStore(ro), info.rank, info.world_size);
  }
}

void Trainer::SetupModel(TrainingModule& module) {
  if (module_ == &module && strategy_ && strategy_->wrapped()) return;
  ST_CHECK_ARG(module_ == nullptr, "this Trainer already set up another module; use one Trainer per module");
  if (!strategy_) strategy_ = strategies::StrategyRegistry::Create(world_size() > 1 ? "ddp" : "single_device");
  if (options_.deterministic) at::globalContext().setDeterministicAlgorithms(true, false);
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
  if (options_.precision == "16-mixed" && options_.grad_scaler.enabled) {
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
  if (device_.is_cuda()) model->to(device_);
  strategy_->WrapModel(model);
  opt_ = module.configure_optimizers(strategy_->parameters());
  ST_CHECK_ARG(opt_.optimizer != nullptr, "configure_optimizers returned no optimizer");
  internal::CheckOptimizerOwnsParameters(*opt_.optimizer, strategy_->parameters(), strategy_->name());
  initial_lrs_.clear();
  for (auto& g : opt_.optimizer->param_groups()) initial_lrs_.push_back(g.options().get_lr());
}

Batch Trainer::ToDevice(Batch b) const {
  if (!device_.is_cpu()) {
    if (b.inputs.defined()) b.inputs = b.inputs.to(device_);
    if (b.targets.defined()) b.targets = b.targets.to(device_);
  }
  const auto dt = strategy_->compute_dtype();
  if (dt != at::kFloat && b.inputs.defined() && at::isFloatingType(b.inputs.scalar_type())) b.inputs = b.inputs.to(dt);
  return b;
}

int64_t Trainer::NumTrainingBatches(const Dataset& train, int world_size) const {
  const auto& o = options_;
  DistributedSampler sampler(train.size(), world_size, 0, /*shuffle=*/false, o.seed, /*drop_last=*/false);
  const int64_t all = static_cast<int64_t>(MakeBatches(sampler.indices(), o.batch_size, o.drop_last).size());
  return LimitBatches(o.limit_train_batches, all);
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
  if (limit > 1.0) return std::min<int64_t>(available, static_cast<int64_t>(limit));
  return static_cast<int64_t>(std::floor(available * limit));
}

std::vector<std::string> Trainer::GatherOptimizerStates() {
  std::string mine = internal::SerializeOptimizer(*opt_.optimizer);
  const int W = world_size();
  if (W == 1) return {mine};
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({W}, at::kLong);
  HostAllGather(*world_, len, lens);
  const int64_t max_len = lens.max().item<int64_t>();
  at::Tensor buf = at::zeros({max_len}, at::kByte);
  std::memcpy(buf.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({W * max_len}, at::kByte);
  HostAllGather(*world_, buf, all);
  std::vector<std::string> out;
  const char* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int r = 0; r < W; ++r) out.emplace_back(p + r * max_len, lens[r].item<int64_t>());
  return out;
}

void Trainer::AgreeOrThrow(bool failed, const std::string& message, const std::string& what) {
  const double any = strategy_->ReduceMax(failed ? 1.0 : 0.0);
  if (any <= 0) return;
  if (failed) throw Error(message);
  ST_THROW(Error, what, " failed on another rank (see its error)");
}

std::map<std::string, std::map<std::string, std::string>> Trainer::CallbackStates() const {
  std::map<std::string, std::map<std::string, std::string>> out;
  for (const auto& cb : options_.callbacks) {
    const std::string key = cb->state_key();
    if (!key.empty()) out[key] = cb->state_dict();
  }
  return out;
}

void Trainer::SaveCheckpoint(const std::string& path, CheckpointFormat format) {
  ST_CHECK_ARG(strategy_ && strategy_->wrapped(), "SaveCheckpoint needs a model (call Fit first)");
  const bool sharded = format == CheckpointFormat::kSharded ||
                       (format == CheckpointFormat::kAuto && strategy_->prefers_sharded_checkpoint());
  ST_CHECK_ARG(!sharded || strategy_->has_sharded_state(), "strategy '", strategy_->name(),
               "' is not sharded: it cannot write sharded checkpoints (use CheckpointFormat::kFull)");
  if (sharded) {
    SaveSharded(path);
  } else {
    SaveFull(path);
  }
  last_ckpt_ = path;
}

void Trainer::SaveFull(const std::string& path) {
  // Streamed: rank 0 opens the file, every rank takes part in gathering one
  // unit at a time, rank 0 writes each tensor as it arrives and drops it.
  const std::string what = "saving checkpoint '" + path + "'";
  std::unique_ptr<ArchiveWriter> writer;
  {
    bool failed = false;
    std::string msg;
    if (rank() == 0) {
      try {
        writer = std::make_unique<ArchiveWriter>(path);
      } catch (const std::exception& e) {
        failed = true;
        msg = e.what();
      }
    }
    AgreeOrThrow(failed, msg, what);
  }
  CheckpointData data;
  // The per-rank LibTorch archives only where "optimizer_full" cannot
  // restore the optimizer (then the file resumes at this world size only).
  if (internal::OptimizerKind(*opt_.optimizer).empty()) data.optimizer_states = GatherOptimizerStates();
  internal::StreamedState streamed = internal::StreamFullState(*strategy_, *opt_.optimizer, writer.get());
  data.epoch = epoch_;
  data.global_step = global_step_;
  data.batch_in_epoch = batch_in_epoch_;
  data.world_size = world_size();
  data.strategy = strategy_->name();
  data.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  data.hparams = module_->hparams();
  data.callbacks = CallbackStates();
  if (scaler_) data.grad_scaler = scaler_->state();
  bool failed = false;
  std::string msg;
  if (rank() == 0) {
    try {
      if (!streamed.error.empty()) throw Error(streamed.error);
      FinishCheckpoint(*writer, data, streamed.state_dict, streamed.optimizer_full);
    } catch (const std::exception& e) {
      failed = true;
      msg = e.what();
    }
    writer.reset();  // after a failure: removes the temporary file
  }
  AgreeOrThrow(failed, msg, what);
}

void Trainer::SaveSharded(const std::string& path) {
  ShardedPiece piece = internal::MakeShardedPiece(*strategy_, *opt_.optimizer);
  CheckpointData meta;
  meta.epoch = epoch_;
  meta.global_step = global_step_;
  meta.batch_in_epoch = batch_in_epoch_;
  meta.world_size = world_size();
  meta.strategy = strategy_->name();
  meta.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  meta.hparams = module_->hparams();
  meta.callbacks = CallbackStates();
  if (scaler_) meta.grad_scaler = scaler_->state();
  const std::string what = "saving sharded checkpoint '" + path + "'";
  auto step = [&](bool mine, const std::function<void()>& fn) {
    bool failed = false;
    std::string msg;
    if (mine) {
      try {
        fn();
      } catch (const std::exception& e) {
        failed = true;
        msg = e.what();
      }
    }
    AgreeOrThrow(failed, msg, what);
  };
  step(rank() == 0, [&] { BeginShardedSave(path); });
  step(true, [&] { WriteShardedPiece(path, piece); });
  step(rank() == 0, [&] { FinishShardedSave(path, meta); });
}

void Trainer::LoadFrom(const std::string& path) {
  // A sharded checkpoint into a sharded strategy: every rank maps the rank
  // files and reads only the ranges of its own new shards (no full model).
  // Replicated strategies need the full model anyway: they load it consolidated.
  std::optional<ShardedCheckpoint> sharded;
  if (IsShardedCheckpoint(path)) sharded = LoadShardedCheckpoint(path);
  const bool direct = sharded && strategy_->has_sharded_state();
  CheckpointData ck = direct ? sharded->meta : sharded ? ConsolidateShardedCheckpoint(*sharded) : LoadCheckpoint(path);
  const int W = world_size();
  // The per-rank LibTorch archives restore everything (including parameter
  // group options) but only into the same strategy at the same world size;
  // the state by parameter name reshards anywhere.
  const bool archives = static_cast<int>(ck.optimizer_states.size()) == W && ck.world_size == W &&
                        ck.strategy == strategy_->name();
  std::function<void()> apply_optimizer;
  std::function<void()> apply_sharded;  // parameters, buffers and optimizer state
  if (direct) {
    apply_sharded = internal::PrepareShardedLoad(*strategy_, *opt_.optimizer, *sharded, path);
  } else if (!archives) {
    if (!ck.optimizer_full.empty()) {
      apply_optimizer = internal::PrepareOptimizerLoad(*strategy_, *opt_.optimizer, ck.optimizer_full, path);
    } else if (!ck.optimizer_states.empty()) {
      ST_THROW(Error, "checkpoint '", path, "' holds optimizer state of ", ck.optimizer_states.size(), " ranks (",
               ck.strategy, ") but this run has ", W, " (", strategy_->name(),
               "); only Adam, AdamW and SGD state is saved in a form that loads at another world size or strategy");
    }
  }
  std::optional<GradScaler> scaler;  // checked now, installed with the rest
  if (scaler_ && ck.grad_scaler) {
    scaler.emplace(*scaler_);
    try {
      scaler->load_state(*ck.grad_scaler);
    } catch (const std::exception& e) {
      ST_THROW(Error, "checkpoint '", path, "': ", e.what());
    }
  }
  if (apply_sharded) {
    apply_sharded();  // checks everything before changing anything
  } else {
    strategy_->LoadFullStateDict(ck.state_dict);  // checks everything before changing anything
    if (archives) {
      internal::LoadOptimizerArchive(*opt_.optimizer, ck.optimizer_states[rank()], path);
    } else if (apply_optimizer) {
      apply_optimizer();
    }
  }
  if (ck.rng_state.defined() && ck.rng_state.numel() > 0) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(ck.rng_state);
  }
  for (const auto& cb : options_.callbacks) {
    auto it = ck.callbacks.find(cb->state_key());
    if (!cb->state_key().empty() && it != ck.callbacks.end()) cb->load_state_dict(it->second);
  }
  if (scaler) *scaler_ = *scaler;
  epoch_ = ck.epoch;
  global_step_ = ck.global_step;
  batch_in_epoch_ = ck.batch_in_epoch;
  if (rank() == 0) {
    ST_LOG(INFO) << "resumed from " << path << " (saved at world size " << ck.world_size << ", now " << W
                 << ") at epoch " << epoch_ << ", global step " << global_step_;
  }
}

void Trainer::SyncShouldStop() {
  if (options_.callbacks.empty()) return;
  should_stop_ = strategy_->ReduceMax(should_stop_ ? 1.0 : 0.0) > 0;
}

double Trainer::RunValidation(TrainingModule& module, const Dataset& val) {
  module.on_validation_start();
  for (auto& cb : options_.callbacks) cb->on_validation_start(*this, module);
  torch::nn::Module& model = strategy_->module();
  const bool was_training = model.is_training();
  model.eval();
  // What training_step log()ged for the next training row waits until validation is done.
  std::map<std::string, double> pending = std::move(module.logged_);
  module.logged_.clear();
  std::map<std::string, std::pair<double, int64_t>> logged;  // name -> (sum, count) over batches
  double sum = 0;
  int64_t n = 0;
  bool any = true;
  {
    at::NoGradGuard no_grad;
    DistributedSampler sampler(val.size(), world_size(), rank(), /*shuffle=*/false, options_.seed, false);
    auto batches = MakeBatches(sampler.indices(),
                               options_.val_batch_size > 0 ? options_.val_batch_size : options_.batch_size, false);
    const int64_t nb = LimitBatches(options_.limit_val_batches, static_cast<int64_t>(batches.size()));
    for (int64_t i = 0; i < nb; ++i) {
      Batch b = ToDevice(val.get_batch(batches[i]));
      auto loss = module.validation_step(b, i);
      for (const auto& [k, v] : module.logged_) {
        logged[k].first += v;
        ++logged[k].second;
      }
      module.logged_.clear();
      if (!loss) {
        any = false;
        break;
      }
      sum += loss->item<double>();
      ++n;
    }
  }
  module.logged_ = std::move(pending);
  if (was_training) model.train();
  double mean = std::numeric_limits<double>::quiet_NaN();
  std::map<std::string, double> row;
  for (const auto& [k, sc] : logged) {
    // Same names on every rank (as for training logs); a mean over all batches of all ranks.
    row[k] = strategy_->ReduceSum(sc.first) / std::max(1.0, strategy_->ReduceSum(static_cast<double>(sc.second)));
  }
  if (any) {
    mean = strategy_->ReduceSum(sum) / std::max(1.0, strategy_->ReduceSum(static_cast<double>(n)));
    val_losses_.push_back(mean);
    row["val_loss"] = mean;
  }
  for (const auto& [k, v] : row) callback_metrics_[k] = v;
  if (!row.empty()) {
    row["epoch"] = static_cast<double>(epoch_);
    LogMetrics(row, global_step_);  // at the global step at which validation ran
  }
  module.on_validation_end();
  for (auto& cb : options_.callbacks) cb->on_validation_end(*this, module);
  return mean;
}

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
  std::string root = loggers_.empty() ? o.default_root_dir : loggers_.front()->log_dir();
  if (world_size() > 1) {
    at::Tensor len = at::full({1}, static_cast<int64_t>(root.size()), at::kLong);
    strategy_->Broadcast(len, 0);
    at::Tensor buf = at::zeros({len.item<int64_t>()}, at::kByte);
    if (rank() == 0 && !root.empty()) std::memcpy(buf.data_ptr<uint8_t>(), root.data(), root.size());
    strategy_->Broadcast(buf, 0);
    root.assign(reinterpret_cast<const char*>(buf.data_ptr<uint8_t>()), buf.numel());
  }
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

void Trainer::Fit(TrainingModule& module, const Dataset& train, const Dataset* val, const std::string& ckpt_path) {
  ST_CHECK_ARG(!fitting_, "Trainer::Fit is already running");
  struct FittingScope {
    bool& flag;
    explicit FittingScope(bool& f) : flag(f) { flag = true; }
    ~FittingScope() { flag = false; }
  } fitting(fitting_);
  SetupProcesses();
  const auto& o = options_;
  const int W = world_size();
  fit_train_batches_ = NumTrainingBatches(train, W);  // for estimated_stepping_batches() in configure_optimizers
  SetupModel(module);
  SetupLoggers(module);
  callback_metrics_.clear();
  should_stop_ = false;
  if (!ckpt_path.empty()) LoadFrom(ckpt_path);
  step_losses_.clear();
  val_losses_.clear();
  bool builtin_checkpoints = o.enable_checkpointing;
  for (const auto& cb : o.callbacks) {
    if (dynamic_cast<ModelCheckpoint*>(cb.get())) builtin_checkpoints = false;
  }

  const auto clip_algo = strategies::ParseGradClipAlgorithm(o.gradient_clip_algorithm);
  DistributedSampler sampler(train.size(), W, rank(), o.shuffle, o.seed, /*drop_last=*/false);
  const int64_t nb = fit_train_batches_;
  ST_CHECK_ARG(nb > 0, "no training batches: dataset of ", train.size(), " samples, ", W, " ranks, batch_size ",
               o.batch_size, ", limit_train_batches ", o.limit_train_batches);
  const int64_t total = estimated_stepping_batches();
  const int64_t val_every = o.val_check_interval > 1.0
                                ? static_cast<int64_t>(o.val_check_interval)
                                : std::max<int64_t>(1, static_cast<int64_t>(std::floor(nb * o.val_check_interval)));
  std::unique_ptr<ProgressReporter> progress;
  if (rank() == 0 && o.enable_progress_bar) progress = std::make_unique<ProgressReporter>(total, o.log_every_n_steps);
  auto reduce_max = [this](double v) { return strategy_->ReduceMax(v); };

  module.on_fit_start();
  for (auto& cb : o.callbacks) cb->on_fit_start(*this, module);
  torch::nn::Module& model = strategy_->module();
  model.train();
  bool stop = o.max_steps >= 0 && global_step_ >= o.max_steps;
  while (!stop && (max_epochs_ < 0 || epoch_ < max_epochs_)) {
    sampler.set_epoch(epoch_);
    auto batches = MakeBatches(sampler.indices(), o.batch_size, o.drop_last);
    module.epoch_ = epoch_;
    if (batch_in_epoch_ == 0) module.on_train_epoch_start(epoch_);
    double acc_loss = 0;
    int64_t acc_n = 0;
    for (int64_t i = batch_in_epoch_; i < nb; ++i) {
      Batch b = ToDevice(train.get_batch(batches[i]));
      const bool sync = (i + 1) % o.accumulate_grad_batches == 0 || i + 1 == nb;
      at::Tensor loss = module.training_step(b, i);
      at::Tensor to_backward = o.accumulate_grad_batches > 1 ? loss / static_cast<double>(o.accumulate_grad_batches) : loss;
      if (scaler_) to_backward = scaler_->Scale(to_backward);
      strategy_->Backward(to_backward, sync);
      module.on_train_batch_end(loss.detach(), i);
      acc_loss += loss.detach().to(at::kDouble).item<double>();
      ++acc_n;
      batch_in_epoch_ = i + 1;
      if (sync) {
        // 16-mixed: unscale before clipping; an overflow on any rank skips the step on every rank.
        const bool skip = scaler_ && scaler_->Unscale(strategy_->parameters(), reduce_max);
        if (!skip && o.gradient_clip_val > 0) strategy_->ClipGradients(o.gradient_clip_val, clip_algo);
        if (opt_.lr_lambda) {
          const double f = opt_.lr_lambda(global_step_);
          auto& groups = opt_.optimizer->param_groups();
          for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(initial_lrs_[g] * f);
        }
        if (!skip) opt_.optimizer->step();
        if (scaler_) scaler_->Update(skip);
        opt_.optimizer->zero_grad();
        ++global_step_;
        module.global_step_ = global_step_;
        const double l = strategy_->ReduceMean(acc_loss / static_cast<double>(acc_n));
        acc_loss = 0;
        acc_n = 0;
        step_losses_.push_back(l);
        std::map<std::string, double> row;
        for (const auto& [k, v] : module.logged_) row[k] = strategy_->ReduceMean(v);
        module.logged_.clear();
        for (const auto& [k, v] : row) callback_metrics_[k] = v;
        callback_metrics_["train_loss"] = l;
        if (!loggers_.empty() && global_step_ % o.log_every_n_steps == 0) {
          row["train_loss"] = l;
          row["epoch"] = static_cast<double>(epoch_);
          row["lr"] = opt_.optimizer->param_groups()[0].options().get_lr();
          if (scaler_) row["grad_scale"] = scaler_->scale();
          LogMetrics(row, global_step_);
        }
        if (progress) progress->Update(epoch_, global_step_, l);
        if (builtin_checkpoints && o.checkpoint_every_n_steps > 0 && global_step_ % o.checkpoint_every_n_steps == 0) {
          SaveCheckpoint((fs::path(ckpt_dir_) / ("step=" + std::to_string(global_step_) + ".ckpt")).string());
        }
        if (o.max_steps >= 0 && global_step_ >= o.max_steps) stop = true;
      }
      for (auto& cb : o.callbacks) cb->on_train_batch_end(*this, module, loss.detach(), i);
      if (sync) {
        SyncShouldStop();
        if (should_stop_) stop = true;
      }
      if (val && (i + 1) % val_every == 0) {
        RunValidation(module, *val);
        SyncShouldStop();
        if (should_stop_ && sync) stop = true;
      }
      if (stop) break;
    }
    if (batch_in_epoch_ >= nb) {
      module.on_train_epoch_end(epoch_);
      const int64_t finished = epoch_;
      ++epoch_;
      batch_in_epoch_ = 0;
      for (auto& cb : o.callbacks) cb->on_train_epoch_end(*this, module, finished);
      SyncShouldStop();
      if (should_stop_) stop = true;
      if (builtin_checkpoints) SaveCheckpoint((fs::path(ckpt_dir_) / "last.ckpt").string());
    }
  }
  if (builtin_checkpoints) SaveCheckpoint((fs::path(ckpt_dir_) / "last.ckpt").string());
  if (progress) progress->Finish();
  for (auto& l : loggers_) l->Save();
  module.on_fit_end();
  for (auto& cb : o.callbacks) cb->on_fit_end(*this, module);
}

}  // namespace shardtrain::trainer
