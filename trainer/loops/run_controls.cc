// Run controls (trainer/loops/run_controls.h) and the Trainer's sanity check.
#include "trainer/loops/run_controls.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include "base/errors.h"
#include "trainer/callbacks/callback.h"
#include "trainer/callbacks/early_stopping.h"
#include "trainer/callbacks/learning_rate_monitor.h"
#include "trainer/callbacks/model_checkpoint.h"
#include "trainer/loops/internal/fit_loop.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace {

std::mutex seed_mu;
std::optional<uint64_t> global_seed;
bool seed_workers = false;

int64_t OverfitCount(double overfit, int64_t available) {
  if (overfit >= 1.0) return std::min<int64_t>(available, static_cast<int64_t>(overfit));
  return std::max<int64_t>(1, static_cast<int64_t>(std::floor(available * overfit)));
}

}  // namespace

void SeedEverything(uint64_t seed, bool workers) {
  at::manual_seed(seed);  // the CPU generator and, when CUDA is present, every device's
  std::srand(static_cast<unsigned>(seed));
  std::lock_guard<std::mutex> lock(seed_mu);
  global_seed = seed;
  seed_workers = workers;
}

std::optional<uint64_t> GlobalSeed() {
  std::lock_guard<std::mutex> lock(seed_mu);
  return global_seed;
}

bool SeedWorkers() {
  std::lock_guard<std::mutex> lock(seed_mu);
  return seed_workers;
}

uint64_t WorkerSeed(uint64_t base, int rank, int worker) {
  // splitmix64 of (base, rank, worker): distinct streams, the same for the same inputs.
  uint64_t z = base ^ (static_cast<uint64_t>(rank) << 32) ^ static_cast<uint64_t>(worker) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

int64_t LimitBatches(const TrainerOptions& o, Stage stage, int64_t available) {
  if (o.fast_dev_run > 0) return std::min<int64_t>(available, o.fast_dev_run);
  if (o.overfit_batches > 0 && (stage == Stage::kFit || stage == Stage::kValidate)) {
    return OverfitCount(o.overfit_batches, available);
  }
  const double limit = stage == Stage::kFit      ? o.limit_train_batches
                       : stage == Stage::kValidate ? o.limit_val_batches
                       : stage == Stage::kTest     ? o.limit_test_batches
                                                   : o.limit_predict_batches;
  if (limit > 1.0) return std::min<int64_t>(available, static_cast<int64_t>(limit));
  return static_cast<int64_t>(std::floor(available * limit));
}

std::string BestCheckpointPath(const std::vector<std::shared_ptr<Callback>>& callbacks) {
  const ModelCheckpoint* mc = nullptr;
  for (const auto& cb : callbacks) {
    if (auto* m = dynamic_cast<const ModelCheckpoint*>(cb.get())) {
      mc = m;
      break;
    }
  }
  ST_CHECK_ARG(mc != nullptr,
               "ckpt_path=\"best\" needs a ModelCheckpoint callback (with a monitor) in TrainerOptions::callbacks; "
               "none is there. Add one, or pass ckpt_path=\"last\" or a checkpoint path");
  ST_CHECK_ARG(!mc->options().monitor.empty(),
               "ckpt_path=\"best\": the ModelCheckpoint has no monitor, so no checkpoint is best; set "
               "ModelCheckpointOptions::monitor (e.g. \"val_loss\"), or pass ckpt_path=\"last\" or a checkpoint path");
  ST_CHECK_ARG(!mc->best_model_path().empty(), "ckpt_path=\"best\": the ModelCheckpoint(monitor='",
               mc->options().monitor,
               "') has not saved a checkpoint yet (its best_model_path is empty); fit with it first, or pass "
               "ckpt_path=\"last\" or a checkpoint path");
  return mc->best_model_path();
}

namespace internal {

void ClearGlobalSeed() {
  std::lock_guard<std::mutex> lock(seed_mu);
  global_seed.reset();
  seed_workers = false;
}

TrainerOptions ApplyRunControls(TrainerOptions o) {
  ST_CHECK_ARG(o.fast_dev_run >= 0, "fast_dev_run must be >= 0 (0: off, N: run N batches; true = 1), got ",
               o.fast_dev_run);
  ST_CHECK_ARG(o.num_sanity_val_steps >= -1, "num_sanity_val_steps must be >= 0 or -1 (all), got ",
               o.num_sanity_val_steps);
  ST_CHECK_ARG(o.check_val_every_n_epoch >= 1, "check_val_every_n_epoch must be >= 1, got ",
               o.check_val_every_n_epoch);
  ST_CHECK_ARG(o.overfit_batches >= 0 && std::isfinite(o.overfit_batches),
               "overfit_batches must be 0 (off), a fraction in (0, 1) or a batch count >= 1, got ", o.overfit_batches);
  ST_CHECK_ARG(o.limit_test_batches >= 0 && o.limit_predict_batches >= 0,
               "limit_test_batches and limit_predict_batches must be >= 0 (<= 1.0: a fraction; > 1: a count), got ",
               o.limit_test_batches, " and ", o.limit_predict_batches);
  if (o.seed == 0) {
    if (auto s = GlobalSeed()) o.seed = *s;
  }
  if (o.overfit_batches > 0) {
    o.shuffle = false;     // the same first batches every epoch
    o.val_batch_size = 0;  // validation batches = training batches
  }
  if (o.fast_dev_run > 0) {
    o.max_epochs = 1;
    o.max_steps = o.fast_dev_run;
    o.num_sanity_val_steps = 0;
    o.val_check_interval = 1.0;
    o.check_val_every_n_epoch = 1;
    o.enable_logger = false;
    o.logger_objects.clear();
    o.enable_checkpointing = false;
    o.checkpoint_every_n_steps = 0;
    o.resume = "never";
    std::vector<CallbackPtr> kept;
    for (const auto& cb : o.callbacks) {
      const Callback* c = cb.get();
      if (dynamic_cast<const ModelCheckpoint*>(c) || dynamic_cast<const EarlyStopping*>(c) ||
          dynamic_cast<const LearningRateMonitor*>(c)) {
        continue;
      }
      kept.push_back(cb);
    }
    o.callbacks = std::move(kept);
  }
  return o;
}

bool ValidatesInEpoch(const TrainerOptions& o, int64_t epoch) { return (epoch + 1) % o.check_val_every_n_epoch == 0; }

const Dataset* FitValidationSet(const TrainerOptions& o, const Dataset& train, const Dataset* val) {
  return o.overfit_batches > 0 && val != nullptr ? &train : val;
}

void ApplyDeterminism(bool deterministic) {
  if (!deterministic) return;
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
  // cuBLAS needs a fixed workspace for deterministic results (as Lightning sets it).
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
}

void RunExplainingNondeterminism(bool deterministic, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    const auto at = msg.find(" does not have a deterministic implementation");
    if (!deterministic || at == std::string::npos) throw;
    ST_THROW(InvalidArgumentError, "deterministic=true: the operation '", msg.substr(0, at),
             "' has no deterministic implementation. Set TrainerOptions::deterministic=false, or replace the "
             "operation in the module (torch: ",
             msg.substr(0, std::min<size_t>(msg.size(), 200)), ")");
  }
}

}  // namespace internal

void internal::FitLoop::RunSanityCheck(TrainingModule& module, const Dataset& val) {
  const auto& o = t_.options_;
  if (o.num_sanity_val_steps == 0) return;
  DistributedSampler sampler(val.size(), t_.data_parallel_size(), t_.data_parallel_rank(), /*shuffle=*/false, o.seed,
                             false);
  const auto batches = MakeBatches(sampler.indices(), o.val_batch_size > 0 ? o.val_batch_size : o.batch_size, false);
  int64_t n = trainer::LimitBatches(o, Stage::kValidate, static_cast<int64_t>(batches.size()));
  if (o.num_sanity_val_steps > 0) n = std::min(n, o.num_sanity_val_steps);
  if (n == 0) return;
  struct Scope {
    bool& flag;
    torch::nn::Module& model;
    bool was_training;
    Scope(bool& f, torch::nn::Module& m) : flag(f), model(m), was_training(m.is_training()) {
      flag = true;
      model.eval();
    }
    ~Scope() {
      flag = false;
      if (was_training) model.train();
    }
  } scope(t_.sanity_checking_, t_.strategy_->module());
  std::map<std::string, double> pending = std::move(module.logged_);
  at::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    module.logged_.clear();
    (void)module.validation_step(t_.ToDevice(val.get_batch(batches[i])), i);
  }
  module.logged_ = std::move(pending);  // what validation_step log()ged is not logged
}

}  // namespace shardtrain::trainer
