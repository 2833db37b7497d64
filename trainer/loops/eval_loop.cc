// The evaluation loop (trainer/loops/internal/eval_loop.h) shared by
// validation (in Fit and Trainer::Validate), Trainer::Test and
// Trainer::Predict: this rank's DistributedSampler share (no shuffling) in
// batches, the model in eval mode without gradients; the per-batch sums of a
// validation or test pass, reduced over the ranks in one all-reduce, with
// their hooks and logging; Predict's gather in dataset order.
#include "trainer/loops/internal/eval_loop.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <limits>
#include <sstream>

#include "base/errors.h"
#include "comm/host_collectives.h"
#include "trainer/connectors/internal/data_connector.h"
#include "trainer/connectors/internal/metric_log.h"
#include "trainer/connectors/internal/process_connector.h"
#include "trainer/data/data_loader.h"
#include "trainer/loops/run_controls.h"
#include "trainer/profilers/profiler.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {

std::optional<at::Tensor> TrainingModule::test_step(const Batch&, int64_t) {
  ST_THROW(InvalidArgumentError,
           "Trainer::Test needs TrainingModule::test_step: override it to return the batch's mean loss (or "
           "std::nullopt) and log() the test metrics");
}

at::Tensor TrainingModule::predict_step(const Batch&, int64_t) {
  ST_THROW(InvalidArgumentError,
           "Trainer::Predict needs TrainingModule::predict_step: override it to return the batch's predictions, one "
           "row per sample");
}

namespace {

// Samples of rank `rank`'s share that are not padding: position k of its
// list is position rank + k*W of the padded order, padding from n on.
int64_t RealSamples(int64_t n, int world, int rank) { return n > rank ? (n - rank + world - 1) / world : 0; }

// What the steps of one pass returned, as weighted sums (what they log()
// goes through a MetricCollector).
struct LossSums {
  double loss = 0, loss_weight = 0, loss_batches = 0;
  bool every_batch_had_loss = true;

  void AddLoss(double value, double weight) {
    if (weight != 0) loss += weight * value;
    loss_weight += weight;
    ++loss_batches;
  }
};

// What training_step log()ged for the next training row (a module's
// logged_ and log_options_), set aside while an evaluation pass logs into
// the module, which then starts empty; Restore() (or the destructor, on an
// error) puts it back.
class LogStash {
 public:
  LogStash(std::map<std::string, double>& logged, std::map<std::string, LogOptions>& options)
      : logged_(logged), options_(options), kept_logged_(std::move(logged)), kept_options_(std::move(options)) {
    logged.clear();
    options.clear();
  }
  LogStash(const LogStash&) = delete;
  LogStash& operator=(const LogStash&) = delete;
  ~LogStash() { Restore(); }

  void Restore() {
    if (restored_) return;
    restored_ = true;
    logged_ = std::move(kept_logged_);
    options_ = std::move(kept_options_);
  }

 private:
  std::map<std::string, double>& logged_;
  std::map<std::string, LogOptions>& options_;
  std::map<std::string, double> kept_logged_;
  std::map<std::string, LogOptions> kept_options_;
  bool restored_ = false;
};

}  // namespace

void internal::EvalLoop::ForEachEvalBatch(const Dataset& data, Stage stage, bool trim_padding,
                                          const std::function<bool(const Batch&, int64_t, int64_t)>& fn) {
  torch::nn::Module& model = t_.strategy_->module();
  const bool was_training = model.is_training();
  model.eval();
  struct RestoreMode {
    torch::nn::Module& m;
    bool train;
    ~RestoreMode() {
      if (train) m.train();
    }
  } restore{model, was_training};
  at::NoGradGuard no_grad;
  const int W = t_.data_parallel_size(), r = t_.data_parallel_rank();  // ranks reading distinct batches
  DistributedSampler sampler(data.size(), W, r, /*shuffle=*/false, t_.options_.seed, /*drop_last=*/false);
  auto batches = MakeBatches(
      sampler.indices(), t_.options_.val_batch_size > 0 ? t_.options_.val_batch_size : t_.options_.batch_size, false);
  const int64_t nb = trainer::LimitBatches(t_.options_, stage, static_cast<int64_t>(batches.size()));
  batches.resize(nb);
  // Real (non-padding) samples per batch; with trim_padding the batch holds only those.
  const int64_t real_total = RealSamples(data.size(), W, r);
  std::vector<int64_t> real(nb);
  int64_t start = 0;  // position of the batch's first sample in this rank's list
  for (int64_t i = 0; i < nb; ++i) {
    const int64_t size = static_cast<int64_t>(batches[i].size());
    real[i] = std::clamp<int64_t>(real_total - start, 0, size);
    start += size;
    if (trim_padding) batches[i].resize(real[i]);
  }
  DataLoader loader(data, std::move(batches), t_.data_connector_->LoaderOptions(), 0,
                    nb);  // prepared ahead by num_workers threads
  for (int64_t i = 0; i < nb; ++i) {
    Batch b = t_.ToDevice(loader.Next());
    if (!fn(b, i, real[i])) break;
  }
}

double internal::EvalLoop::RunValidation(TrainingModule& module, const Dataset& val) {
  const auto row = RunEvalStage(module, val, EvalStage::kValidation);
  const auto it = row.find("val_loss");
  return it == row.end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
}

std::map<std::string, double> internal::EvalLoop::RunEvalStage(TrainingModule& module, const Dataset& data,
                                                               EvalStage stage) {
  const bool test = stage == EvalStage::kTest;
  auto profiled = t_.Profile(test ? kActionTest : kActionValidation);
  if (test) {
    module.on_test_start();
    for (auto& cb : t_.options_.callbacks) cb->on_test_start(t_, module);
  } else {
    module.on_validation_start();
    for (auto& cb : t_.options_.callbacks) cb->on_validation_start(t_, module);
  }
  // What training_step log()ged for the next training row waits until this pass is done.
  LogStash pending(module.logged_, module.log_options_);
  module.log_eval_defaults_ = true;
  internal::MetricCollector logged({t_.world_.get(), t_.rank(), t_.world_size(), [this](std::vector<double> v) {
                                      return t_.process_connector_->AllReduceSum(std::move(v));
                                    }});
  LossSums sums;
  // Validation: each batch counts 1, padding included, and a step without a
  // loss ends the pass (no validation). Test: each batch counts its real samples.
  ForEachEvalBatch(data, test ? Stage::kTest : Stage::kValidate, /*trim_padding=*/test,
                   [&](const Batch& b, int64_t i, int64_t real) {
                     const std::optional<at::Tensor> loss = test ? module.test_step(b, i) : module.validation_step(b, i);
                     const double weight = test ? static_cast<double>(real) : 1.0;
                     logged.AddBatch(module, weight);
                     if (!loss) {
                       sums.every_batch_had_loss = false;
                       return test;
                     }
                     sums.AddLoss(loss->item<double>(), weight);
                     return true;
                   });
  // What the steps log()ged, aggregated over the batches (and ranks, with
  // sync_dist); every rank must log the same names.
  std::map<std::string, double> row = logged.ReduceEpoch(test ? "test" : "validation");
  const std::vector<double> v = t_.process_connector_->AllReduceSum({sums.loss, sums.loss_weight, sums.loss_batches});
  if (test && v[2] > 0) row["test_loss"] = v[0] / v[1];
  if (!test && sums.every_batch_had_loss) {
    row["val_loss"] = v[0] / std::max(1.0, v[1]);
    t_.val_losses_.push_back(row["val_loss"]);
  }
  for (const auto& [k, x] : row) t_.callback_metrics_[k] = x;
  RunEvalEpochEnd(module, test, row);
  pending.Restore();
  module.log_eval_defaults_ = false;
  if (!row.empty()) {
    std::map<std::string, double> logged_row = row;
    logged_row["epoch"] = static_cast<double>(t_.epoch_);
    t_.LogMetrics(logged_row, t_.global_step_);  // at the global step at which the pass ran
  }
  if (test) {
    module.on_test_end();
    for (auto& cb : t_.options_.callbacks) cb->on_test_end(t_, module);
  } else {
    module.on_validation_end();
    for (auto& cb : t_.options_.callbacks) cb->on_validation_end(t_, module);
  }
  return row;
}

// The module's and then the callbacks' on_{validation,test}_epoch_end, with
// `row` in callback_metrics; what the module log()s there is rank-averaged
// into `row`.
void internal::EvalLoop::RunEvalEpochEnd(TrainingModule& module, bool test, std::map<std::string, double>& row) {
  if (test) {
    module.on_test_epoch_end();
  } else {
    module.on_validation_epoch_end();
  }
  if (!module.logged_.empty()) {  // log()ged in the epoch-end hook: rank-averaged into the row
    std::vector<std::string> names;
    std::vector<double> x;
    for (const auto& [k, value] : module.logged_) {
      names.push_back(k);
      x.push_back(value);
    }
    module.logged_.clear();
    module.log_options_.clear();
    x = t_.process_connector_->AllReduceSum(std::move(x));
    for (size_t k = 0; k < names.size(); ++k) row[names[k]] = t_.callback_metrics_[names[k]] = x[k] / t_.world_size();
  }
  for (auto& cb : t_.options_.callbacks) {
    if (test) {
      cb->on_test_epoch_end(t_, module);
    } else {
      cb->on_validation_epoch_end(t_, module);
    }
  }
}

void internal::EvalLoop::SetupForEval(TrainingModule& module, const char* what, const Dataset& data) {
  ST_CHECK_ARG(!t_.fitting_, "Trainer::", what, " cannot run inside Fit; call it after Fit returned");
  ST_CHECK_ARG(data.size() > 0, "Trainer::", what, ": the data set is empty; give it at least one sample");
  t_.process_connector_->SetupProcesses();
  t_.SetupModel(module);
}

namespace {

// Up to kMaxDims trailing sizes, the number of dimensions and the dtype of one prediction row.
constexpr int kMaxDims = 8;
std::vector<int64_t> RowSignature(const at::Tensor& p) {
  std::vector<int64_t> s = {p.dim(), static_cast<int64_t>(p.scalar_type())};
  for (int d = 1; d < std::min<int64_t>(p.dim(), kMaxDims + 1); ++d) s.push_back(p.size(d));
  s.resize(2 + kMaxDims, -1);
  return s;
}

std::string DescribePrediction(const at::Tensor& p) {
  std::ostringstream os;
  os << p.sizes() << " " << p.scalar_type();
  return os.str();
}

}  // namespace

at::Tensor internal::EvalLoop::Predict(TrainingModule& module, const Dataset& data, const PredictOptions& options) {
  LogStash pending(module.logged_, module.log_options_);  // what predict_step log()s is dropped
  std::vector<at::Tensor> outs;
  ForEachEvalBatch(data, Stage::kPredict, /*trim_padding=*/false, [&](const Batch& b, int64_t i, int64_t) {
    at::Tensor p = module.predict_step(b, i);
    const int64_t rows = b.inputs.defined() ? b.inputs.size(0) : b.targets.size(0);
    ST_CHECK_ARG(p.defined() && p.dim() >= 1 && p.size(0) == rows, "predict_step(batch ", i, ") returned ",
                 p.defined() ? DescribePrediction(p) : std::string("an undefined tensor"), " for a batch of ", rows,
                 " samples; it must return one row (dimension 0) per sample");
    ST_CHECK_ARG(p.dim() <= kMaxDims + 1, "predict_step returned ", DescribePrediction(p), "; at most ", kMaxDims + 1,
                 " dimensions are supported");
    ST_CHECK_ARG(outs.empty() || RowSignature(p) == RowSignature(outs.front()), "predict_step(batch ", i, ") returned ",
                 DescribePrediction(p), " but batch 0 gave ", DescribePrediction(outs.front()),
                 "; every batch's rows must have the same shape and dtype");
    outs.push_back(p.detach());
    return true;
  });
  pending.Restore();
  const int W = t_.world_size(), r = t_.rank();
  ST_CHECK_ARG(t_.data_parallel_size() == W, "Predict: the strategy ", t_.strategy_->name(),
               " reads each batch on several ranks (data_parallel_size ", t_.data_parallel_size(), " of ", W,
               " ranks), which Predict's gather does not support yet; predict with a data-parallel strategy");
  at::Tensor mine = at::cat(outs, 0);  // this rank's share, padding duplicates at the end
  // Samples covered: all, or (limit_predict_batches) the first W * rows of
  // the interleaved order; every rank has the same number of rows.
  const int64_t n = std::min<int64_t>(data.size(), W * mine.size(0));
  if (!options.gather || W == 1) return mine.narrow(0, 0, std::min<int64_t>(mine.size(0), RealSamples(n, W, r)));
  // Every rank's rows must agree in shape and dtype for the all-gather.
  const std::vector<int64_t> sig = RowSignature(mine);
  std::vector<double> extremes;
  for (int64_t x : sig) extremes.push_back(static_cast<double>(x));
  for (int64_t x : sig) extremes.push_back(-static_cast<double>(x));
  at::Tensor t = at::tensor(extremes, at::kDouble).to(comm::CollectiveDevice(*t_.world_));
  comm::HostAllReduce(*t_.world_, t, comm::ReduceOp::kMax);
  t = t.cpu();
  const double* e = t.data_ptr<double>();
  for (size_t k = 0; k < sig.size(); ++k) {
    ST_CHECK_ARG(e[k] == -e[k + sig.size()], "predict_step's rows differ between ranks (rank ", r, " returned rows of ",
                 DescribePrediction(mine.narrow(0, 0, std::min<int64_t>(1, mine.size(0)))),
                 "); every rank must return the same shape after dimension 0 and the same dtype");
  }
  const at::Tensor flat = mine.contiguous().to(comm::CollectiveDevice(*t_.world_));
  std::vector<int64_t> shape = mine.sizes().vec();
  at::Tensor all = at::empty({W * flat.numel()}, flat.options());
  comm::HostAllGather(*t_.world_, flat.reshape(-1), all);
  // Rank q's row k is sample q + k*W: [W, per rank, ...] -> [per rank, W, ...] -> dataset order.
  std::vector<int64_t> by_rank = shape;
  by_rank.insert(by_rank.begin(), W);
  shape[0] *= W;
  return all.view(by_rank).transpose(0, 1).reshape(shape).narrow(0, 0, n);
}

}  // namespace shardtrain::trainer
