#include "trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
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
#include <sstream>

#include "comm/cluster_environment.h"
#include "comm/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/launcher.h"
#include "comm/logging.h"
#include "comm/rendezvous.h"
#include "trainer/checkpoint.h"
#include "trainer/csv_logger.h"
#include "trainer/progress.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;

strategies::Strategy& TrainingModule::strategy() {
  ST_CHECK_ARG(strategy_ != nullptr, "TrainingModule: no strategy yet (only valid inside Trainer::Fit/Validate)");
  return *strategy_;
}

Trainer::Trainer(TrainerOptions options, comm::CommunicatorPtr world)
    : options_(std::move(options)), world_(std::move(world)) {
  const auto& o = options_;
  ST_CHECK_ARG(o.accelerator == "cpu" || o.accelerator == "auto", "unknown or unsupported accelerator '",
               o.accelerator, "'; valid: cpu, auto (CUDA training is not available in this build)");
  ST_CHECK_ARG(o.devices >= 1 && o.num_nodes >= 1, "devices and num_nodes must be >= 1, got ", o.devices, " and ",
               o.num_nodes);
  strategies::CheckPrecision(o.precision);
  strategies::ParseGradClipAlgorithm(o.gradient_clip_algorithm);
  ST_CHECK_ARG(o.gradient_clip_val >= 0, "gradient_clip_val must be >= 0, got ", o.gradient_clip_val);
  ST_CHECK_ARG(o.max_epochs >= 0 || o.max_steps >= 0, "max_epochs=-1 (unlimited) needs max_steps");
  ST_CHECK_ARG(o.accumulate_grad_batches >= 1, "accumulate_grad_batches must be >= 1, got ",
               o.accumulate_grad_batches);
  ST_CHECK_ARG(o.val_check_interval > 0, "val_check_interval must be > 0, got ", o.val_check_interval);
  ST_CHECK_ARG(o.limit_train_batches >= 0 && o.limit_val_batches >= 0, "limit_*_batches must be >= 0");
  ST_CHECK_ARG(o.batch_size >= 1 && o.val_batch_size >= 0, "batch_size must be >= 1, got ", o.batch_size);
  ST_CHECK_ARG(o.log_every_n_steps >= 1, "log_every_n_steps must be >= 1, got ", o.log_every_n_steps);
  if (o.strategy_object) {
    strategy_ = o.strategy_object;
  } else if (o.strategy != "auto") {
    strategy_ = strategies::StrategyRegistry::Create(o.strategy, o.strategy_options);  // fails early on bad options
  } else {
    ST_CHECK_ARG(o.strategy_options.empty(), "strategy 'auto' takes no options; name the strategy");
  }
}

Trainer::~Trainer() = default;

strategies::Strategy& Trainer::strategy() {
  ST_CHECK_ARG(strategy_ != nullptr, "Trainer: no strategy yet (before Fit with strategy 'auto')");
  return *strategy_;
}

int Trainer::rank() const { return world_ ? world_->rank() : 0; }
int Trainer::world_size() const { return world_ ? world_->size() : 1; }
std::string Trainer::log_dir() const { return logger_ ? logger_->log_dir() : ""; }

void Trainer::SetupProcesses() {
  if (world_) return;
  const int W = options_.devices * options_.num_nodes;
  if (W == 1) {
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
    lo.num_ranks = options_.devices;
    LaunchLocalRanks(lo);
    info = DetectClusterEnvironment();
  }
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
  world_ = comm::GlooCommunicator::Create(comm::CreateStore(ro), info.rank, info.world_size);
}

void Trainer::SetupModel(TrainingModule& module) {
  if (module_ == &module && strategy_ && strategy_->wrapped()) return;
  ST_CHECK_ARG(module_ == nullptr, "this Trainer already set up another module; use one Trainer per module");
  if (!strategy_) strategy_ = strategies::StrategyRegistry::Create(world_size() > 1 ? "ddp" : "single_device");
  if (options_.deterministic) at::globalContext().setDeterministicAlgorithms(true, false);
  at::manual_seed(options_.seed);
  ClusterInfo cluster;
  cluster.rank = rank();
  cluster.world_size = world_size();
  cluster.local_world_size = options_.num_nodes == 1 ? world_size() : options_.devices;
  cluster.local_rank = rank() % cluster.local_world_size;
  cluster.num_nodes = options_.num_nodes;
  strategy_->SetPrecision(options_.precision);
  strategy_->Setup(world_, cluster);
  module.strategy_ = strategy_.get();
  module_ = &module;
  auto model = module.configure_model();
  ST_CHECK_ARG(model != nullptr, "configure_model returned no module");
  strategy_->WrapModel(model);
  opt_ = module.configure_optimizers(strategy_->parameters());
  ST_CHECK_ARG(opt_.optimizer != nullptr, "configure_optimizers returned no optimizer");
  initial_lrs_.clear();
  for (auto& g : opt_.optimizer->param_groups()) initial_lrs_.push_back(g.options().get_lr());
}

int64_t Trainer::LimitBatches(double limit, int64_t available) const {
  if (limit > 1.0) return std::min<int64_t>(available, static_cast<int64_t>(limit));
  return static_cast<int64_t>(std::floor(available * limit));
}

std::vector<std::string> Trainer::GatherOptimizerStates() {
  torch::serialize::OutputArchive ar;
  opt_.optimizer->save(ar);
  std::ostringstream os;
  ar.save_to(os);
  std::string mine = os.str();
  const int W = world_size();
  if (W == 1) return {mine};
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({W}, at::kLong);
  world_->AllGather(len, lens)->Wait();
  const int64_t max_len = lens.max().item<int64_t>();
  at::Tensor buf = at::zeros({max_len}, at::kByte);
  std::memcpy(buf.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({W * max_len}, at::kByte);
  world_->AllGather(buf, all)->Wait();
  std::vector<std::string> out;
  const char* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int r = 0; r < W; ++r) out.emplace_back(p + r * max_len, lens[r].item<int64_t>());
  return out;
}

void Trainer::SaveCheckpoint(const std::string& path) {
  ST_CHECK_ARG(strategy_ && strategy_->wrapped(), "SaveCheckpoint needs a model (call Fit first)");
  CheckpointData data;
  data.state_dict = strategy_->FullStateDict();
  data.optimizer_states = GatherOptimizerStates();
  data.epoch = epoch_;
  data.global_step = global_step_;
  data.batch_in_epoch = batch_in_epoch_;
  data.world_size = world_size();
  data.strategy = strategy_->name();
  data.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  data.hparams = module_->hparams();
  if (rank() == 0) trainer::SaveCheckpoint(path, data);
  strategy_->Barrier();
  last_ckpt_ = path;
}

void Trainer::LoadFrom(const std::string& path) {
  CheckpointData ck = LoadCheckpoint(path);
  const int W = world_size();
  ST_CHECK_ARG(static_cast<int>(ck.optimizer_states.size()) == W, "checkpoint '", path, "' holds optimizer state of ",
               ck.optimizer_states.size(), " ranks but this run has ", W,
               " (optimizer state is saved per rank; resume at the same world size)");
  strategy_->LoadFullStateDict(ck.state_dict);
  try {
    torch::serialize::InputArchive ar;
    std::istringstream is(ck.optimizer_states[rank()]);
    ar.load_from(is);
    opt_.optimizer->load(ar);
  } catch (const c10::Error& e) {
    std::string what = e.what();
    ST_THROW(Error, "checkpoint '", path, "': optimizer state does not fit this optimizer: ",
             what.substr(0, what.find('\n')));
  }
  if (ck.rng_state.defined() && ck.rng_state.numel() > 0) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(ck.rng_state);
  }
  epoch_ = ck.epoch;
  global_step_ = ck.global_step;
  batch_in_epoch_ = ck.batch_in_epoch;
  if (rank() == 0) {
    ST_LOG(INFO) << "resumed from " << path << " at epoch " << epoch_ << ", global step " << global_step_;
  }
}

double Trainer::RunValidation(TrainingModule& module, const Dataset& val) {
  torch::nn::Module& model = strategy_->module();
  model.eval();
  at::NoGradGuard no_grad;
  DistributedSampler sampler(val.size(), world_size(), rank(), /*shuffle=*/false, options_.seed, false);
  auto batches = MakeBatches(sampler.indices(), options_.val_batch_size > 0 ? options_.val_batch_size : options_.batch_size,
                             false);
  const int64_t nb = LimitBatches(options_.limit_val_batches, static_cast<int64_t>(batches.size()));
  double sum = 0;
  int64_t n = 0;
  bool any = true;
  for (int64_t i = 0; i < nb; ++i) {
    Batch b = val.get_batch(batches[i]);
    const auto dt = strategy_->compute_dtype();
    if (dt != at::kFloat && at::isFloatingType(b.inputs.scalar_type())) b.inputs = b.inputs.to(dt);
    auto loss = module.validation_step(b, i);
    if (!loss) {
      any = false;
      break;
    }
    sum += loss->item<double>();
    ++n;
  }
  model.train();
  if (!any) return std::numeric_limits<double>::quiet_NaN();
  const double mean = strategy_->ReduceSum(sum) / std::max(1.0, strategy_->ReduceSum(static_cast<double>(n)));
  val_losses_.push_back(mean);
  if (logger_) {
    logger_->LogMetrics({{"val_loss", mean}, {"epoch", static_cast<double>(epoch_)}}, global_step_);
    logger_->Save();
  }
  return mean;
}

double Trainer::Validate(TrainingModule& module, const Dataset& val) {
  SetupProcesses();
  SetupModel(module);
  return RunValidation(module, val);
}

void Trainer::Fit(TrainingModule& module, const Dataset& train, const Dataset* val, const std::string& ckpt_path) {
  SetupProcesses();
  SetupModel(module);
  const auto& o = options_;
  const int W = world_size();
  if (rank() == 0 && o.enable_logger) {
    logger_ = std::make_unique<CsvLogger>(o.default_root_dir, o.logger_name);
    auto hp = module.hparams();
    hp.emplace("strategy", strategy_->name());
    hp.emplace("precision", o.precision);
    hp.emplace("world_size", std::to_string(W));
    hp.emplace("batch_size", std::to_string(o.batch_size));
    hp.emplace("accumulate_grad_batches", std::to_string(o.accumulate_grad_batches));
    hp.emplace("seed", std::to_string(o.seed));
    logger_->LogHyperparams(hp);
  }
  ckpt_dir_ = ((logger_ ? fs::path(logger_->log_dir()) : fs::path(o.default_root_dir)) / "checkpoints").string();
  if (!ckpt_path.empty()) LoadFrom(ckpt_path);
  step_losses_.clear();
  val_losses_.clear();

  const auto clip_algo = strategies::ParseGradClipAlgorithm(o.gradient_clip_algorithm);
  DistributedSampler sampler(train.size(), W, rank(), o.shuffle, o.seed, /*drop_last=*/false);
  const int64_t nb_all = static_cast<int64_t>(MakeBatches(sampler.indices(), o.batch_size, o.drop_last).size());
  const int64_t nb = LimitBatches(o.limit_train_batches, nb_all);
  ST_CHECK_ARG(nb > 0, "no training batches: dataset of ", train.size(), " samples, ", W, " ranks, batch_size ",
               o.batch_size, ", limit_train_batches ", o.limit_train_batches);
  const int64_t steps_per_epoch = (nb + o.accumulate_grad_batches - 1) / o.accumulate_grad_batches;
  int64_t total = o.max_epochs >= 0 ? steps_per_epoch * o.max_epochs : -1;
  if (o.max_steps >= 0) total = total >= 0 ? std::min(total, o.max_steps) : o.max_steps;
  const int64_t val_every = o.val_check_interval > 1.0
                                ? static_cast<int64_t>(o.val_check_interval)
                                : std::max<int64_t>(1, static_cast<int64_t>(std::floor(nb * o.val_check_interval)));
  std::unique_ptr<ProgressReporter> progress;
  if (rank() == 0 && o.enable_progress_bar) progress = std::make_unique<ProgressReporter>(total, o.log_every_n_steps);

  module.on_fit_start();
  torch::nn::Module& model = strategy_->module();
  model.train();
  bool stop = o.max_steps >= 0 && global_step_ >= o.max_steps;
  while (!stop && (o.max_epochs < 0 || epoch_ < o.max_epochs)) {
    sampler.set_epoch(epoch_);
    auto batches = MakeBatches(sampler.indices(), o.batch_size, o.drop_last);
    module.epoch_ = epoch_;
    if (batch_in_epoch_ == 0) module.on_train_epoch_start(epoch_);
    double acc_loss = 0;
    int64_t acc_n = 0;
    for (int64_t i = batch_in_epoch_; i < nb; ++i) {
      Batch b = train.get_batch(batches[i]);
      const auto dt = strategy_->compute_dtype();
      if (dt != at::kFloat && at::isFloatingType(b.inputs.scalar_type())) b.inputs = b.inputs.to(dt);
      const bool sync = (i + 1) % o.accumulate_grad_batches == 0 || i + 1 == nb;
      at::Tensor loss = module.training_step(b, i);
      strategy_->Backward(o.accumulate_grad_batches > 1 ? loss / static_cast<double>(o.accumulate_grad_batches) : loss,
                          sync);
      module.on_train_batch_end(loss.detach(), i);
      acc_loss += loss.detach().to(at::kDouble).item<double>();
      ++acc_n;
      batch_in_epoch_ = i + 1;
      if (sync) {
        if (o.gradient_clip_val > 0) strategy_->ClipGradients(o.gradient_clip_val, clip_algo);
        if (opt_.lr_lambda) {
          const double f = opt_.lr_lambda(global_step_);
          auto& groups = opt_.optimizer->param_groups();
          for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(initial_lrs_[g] * f);
        }
        opt_.optimizer->step();
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
        if (logger_ && global_step_ % o.log_every_n_steps == 0) {
          row["train_loss"] = l;
          row["epoch"] = static_cast<double>(epoch_);
          row["lr"] = opt_.optimizer->param_groups()[0].options().get_lr();
          logger_->LogMetrics(row, global_step_);
          logger_->Save();
        }
        if (progress) progress->Update(epoch_, global_step_, l);
        if (o.enable_checkpointing && o.checkpoint_every_n_steps > 0 && global_step_ % o.checkpoint_every_n_steps == 0) {
          SaveCheckpoint((fs::path(ckpt_dir_) / ("step=" + std::to_string(global_step_) + ".ckpt")).string());
        }
        if (o.max_steps >= 0 && global_step_ >= o.max_steps) stop = true;
      }
      if (val && (i + 1) % val_every == 0) RunValidation(module, *val);
      if (stop) break;
    }
    if (batch_in_epoch_ >= nb) {
      module.on_train_epoch_end(epoch_);
      ++epoch_;
      batch_in_epoch_ = 0;
      if (o.enable_checkpointing) SaveCheckpoint((fs::path(ckpt_dir_) / "last.ckpt").string());
    }
  }
  if (o.enable_checkpointing) SaveCheckpoint((fs::path(ckpt_dir_) / "last.ckpt").string());
  if (progress) progress->Finish();
  if (logger_) logger_->Save();
  module.on_fit_end();
}

}  // namespace shardtrain::trainer
