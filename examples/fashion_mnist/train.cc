// examples/fashion_mnist: a CNN on Fashion-MNIST, trained by the Trainer with
// any registered strategy (default fsdp_native: FULL_SHARD over 2 CPU ranks).
//
//   tools/bazel run //examples/fashion_mnist:train -- --max_epochs=3
//
// Data: the IDX files of Debian's `dataset-fashion-mnist` package
// (/usr/share/datasets/fashion-mnist) or --data_dir. The last --val_size
// training images validate after every epoch; the 10 000 test images give the
// test accuracy at the end (Trainer::Test). Ranks: --devices=N on one machine
// (the Trainer re-executes this binary for ranks 1..N-1; --devices=auto with
// --accelerator=cuda: one rank per GPU); under torchrun --no-python, srun
// or mpirun the launcher's ranks are joined instead. Logs and checkpoints:
// <default_root_dir>/lightning_logs/version_N/; --ckpt_path resumes.
#include <ATen/ATen.h>
#include <gflags/gflags.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "base/errors.h"
#include "examples/common/example_util.h"
#include "examples/common/flag_checks.h"
#include "examples/common/trainer_flags.h"
#include "examples/fashion_mnist/cnn_model.h"
#include "examples/fashion_mnist/fashion_mnist.h"
#include "strategies/registry.h"
#include "trainer/callbacks/callback.h"
#include "trainer/trainer.h"

DEFINE_string(data_dir, shardtrain::examples::kFashionMnistDebianDir,
              "directory with the Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz], ...)");
DEFINE_int64(max_epochs, 3, "epochs to train");
DEFINE_int64(max_steps, -1, "stop after this many optimizer steps (-1: no limit)");
DEFINE_int64(batch_size, 64, "images per rank per step");
DEFINE_double(lr, 1e-3, "Adam learning rate");
DEFINE_string(lr_schedule, "cosine", "cosine (decay to 0 over the run's max_epochs/max_steps) or constant");
DEFINE_double(dropout, 0.25, "dropout before the classifier head");
DEFINE_int64(val_size, 5000, "training images held out for validation (0: none)");
DEFINE_string(default_root_dir, "", "logs and checkpoints go to DIR/lightning_logs/version_N (default: the current directory)");
DEFINE_string(ckpt_path, "", "resume from this checkpoint (.../checkpoints/last.ckpt), or 'last' for the newest run's");
DEFINE_int64(log_every_n_steps, 50, "progress and CSV log interval in steps");
DEFINE_int32(num_workers, 2,
             "background threads per rank preparing the next batches (the Trainer's num_workers; 0: on the "
             "training thread); the batches, hence the losses, are the same at any value");
DEFINE_uint64(seed, 42, "random seed (initial weights, shuffling, dropout)");
DEFINE_bool(sync_batchnorm, false, "batch norm statistics over the global batch of all ranks (SyncBatchNorm)");

namespace {

using namespace shardtrain;
using examples::PrintLine;

std::string Fmt(const char* format, double a, double b = 0, double c = 0, double d = 0) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), format, a, b, c, d);
  return buf;
}

class FashionMnistModule : public trainer::TrainingModule {
 public:
  // total_steps > 0: cosine decay of the learning rate to 0 over that many steps.
  FashionMnistModule(examples::CnnConfig config, double lr, int64_t total_steps)
      : config_(config), lr_(lr), total_steps_(total_steps) {}

  std::shared_ptr<torch::nn::Module> configure_model() override {
    net_ = std::make_shared<examples::CnnImpl>(config_);
    return net_;
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    at::Tensor logits = forward([&] { return net_->forward(b.inputs); });
    return at::cross_entropy_loss(logits.to(at::kFloat), b.targets);
  }
  std::optional<at::Tensor> validation_step(const trainer::Batch& b, int64_t) override {
    at::Tensor logits = forward([&] { return net_->forward(b.inputs); }).to(at::kFloat);
    val_correct_ += logits.argmax(1).eq(b.targets).sum().item<double>();
    val_seen_ += static_cast<double>(b.targets.numel());
    return at::cross_entropy_loss(logits, b.targets);
  }
  // Trainer::Test: the batch holds only real test images (the Trainer cuts
  // the duplicates a DistributedSampler pads with); its mean loss becomes
  // test_loss and test_acc is averaged over the test images like it.
  std::optional<at::Tensor> test_step(const trainer::Batch& b, int64_t) override {
    at::Tensor logits = forward([&] { return net_->forward(b.inputs); }).to(at::kFloat);
    at::Tensor hit = logits.argmax(1).eq(b.targets);
    log("test_acc", hit.to(at::kDouble).mean().item<double>());
    const at::Tensor targets = b.targets.cpu();
    test_correct_.index_add_(0, targets, hit.cpu().to(at::kDouble));
    test_count_.index_add_(0, targets, at::ones({targets.numel()}, at::kDouble));
    return at::cross_entropy_loss(logits, b.targets);
  }
  void on_test_start() override {
    const int64_t C = static_cast<int64_t>(examples::kFashionMnistClasses.size());
    test_correct_ = at::zeros({C}, at::kDouble);
    test_count_ = at::zeros({C}, at::kDouble);
  }
  // Per-class accuracy over all ranks (collective: every rank runs this hook).
  void on_test_epoch_end() override {
    per_class_.clear();
    test_correct_total_ = test_total_ = 0;
    for (int64_t c = 0; c < test_count_.numel(); ++c) {
      const double k = strategy().ReduceSum(test_correct_[c].item<double>());
      const double n = strategy().ReduceSum(test_count_[c].item<double>());
      test_correct_total_ += static_cast<int64_t>(k);
      test_total_ += static_cast<int64_t>(n);
      per_class_.push_back(n > 0 ? k / n : 0.0);
    }
  }
  trainer::OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    trainer::OptimizerConfig c;
    c.optimizer = std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(lr_));
    if (total_steps_ > 0) {
      // Cosine to 0 as a LambdaLR (not CosineAnnealingLR: PyTorch's recursive
      // form differs by up to 1.4e-15 relative, and the lrs stay bit for bit).
      const double total = static_cast<double>(total_steps_);
      c.lr_schedulers = {{std::make_shared<trainer::LambdaLR>(
                              c.optimizer,
                              [total](int64_t step) {
                                return 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, static_cast<double>(step) / total)));
                              }),
                          "step"}};
    }
    return c;
  }
  std::map<std::string, std::string> hparams() const override {
    return {{"model", "cnn"},
            {"channels", std::to_string(config_.channels1) + "," + std::to_string(config_.channels2)},
            {"hidden", std::to_string(config_.hidden)},
            {"dropout", shardtrain::trainer::HparamValue(config_.dropout)},
            {"lr", shardtrain::trainer::HparamValue(lr_)},
            {"lr_schedule", total_steps_ > 0 ? "cosine over " + std::to_string(total_steps_) + " steps" : "constant"}};
  }

  // Of the last Trainer::Test, over all ranks.
  const std::vector<double>& test_per_class() const { return per_class_; }
  int64_t test_correct() const { return test_correct_total_; }
  int64_t test_total() const { return test_total_; }
  // Validation accuracy counted since the last call, over all ranks (collective).
  double TakeValAccuracy() {
    const double correct = strategy().ReduceSum(val_correct_), seen = strategy().ReduceSum(val_seen_);
    val_correct_ = val_seen_ = 0;
    return seen > 0 ? correct / seen : 0.0;
  }

 private:
  examples::CnnConfig config_;
  double lr_;
  int64_t total_steps_;
  std::shared_ptr<examples::CnnImpl> net_;
  double val_correct_ = 0, val_seen_ = 0;
  at::Tensor test_correct_, test_count_;  // per class, this rank
  std::vector<double> per_class_;
  int64_t test_correct_total_ = 0, test_total_ = 0;
};

// Prints (rank 0) and logs the validation loss and accuracy after each validation.
class ReportCallback : public trainer::Callback {
 public:
  void on_fit_start(trainer::Trainer&, trainer::TrainingModule&) override { t0_ = std::chrono::steady_clock::now(); }
  void on_validation_end(trainer::Trainer& trainer, trainer::TrainingModule& module) override {
    const double acc = static_cast<FashionMnistModule&>(module).TakeValAccuracy();
    trainer.LogMetrics({{"val_acc", acc}}, trainer.global_step());
    if (trainer.rank() != 0) return;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    const auto& m = trainer.callback_metrics();
    const double val_loss = m.count("val_loss") ? m.at("val_loss") : 0.0;
    std::ostringstream os;
    os << "epoch " << trainer.current_epoch() << " step " << trainer.global_step()
       << Fmt(" | val loss %.4f | val acc %.2f%% | %.0f s", val_loss, 100.0 * acc, secs);
    PrintLine(os.str());
  }

 private:
  std::chrono::steady_clock::time_point t0_;
};

// Every numeric and enum flag's range (docs: examples/README.md); RunExampleMain exits 2 on a bad one.
void CheckFlags() {
  using examples::CheckIntFlagOr;
  CheckIntFlagOr("max_epochs", FLAGS_max_epochs, -1, "no limit", 1);
  CheckIntFlagOr("max_steps", FLAGS_max_steps, -1, "no limit", 1);
  examples::CheckIntFlag("batch_size", FLAGS_batch_size, 1, 1 << 20);
  examples::CheckDoubleFlag("lr", FLAGS_lr, 0, examples::kNoMax, /*min_open=*/true);
  examples::CheckChoiceFlag("lr_schedule", FLAGS_lr_schedule, {"cosine", "constant"});
  if (FLAGS_lr_schedule == "cosine" && FLAGS_max_epochs == -1 && FLAGS_max_steps == -1) {
    examples::FailFlag("lr_schedule", FLAGS_lr_schedule, "constant, or give --max_epochs or --max_steps",
                       "cosine decays over a finite run");
  }
  examples::CheckDoubleFlag("dropout", FLAGS_dropout, 0, 1, false, /*max_open=*/true);
  examples::CheckIntFlag("val_size", FLAGS_val_size, 0);  // and < the training images: checked once they are read
  examples::CheckIntFlag("log_every_n_steps", FLAGS_log_every_n_steps, 1);
  examples::CheckIntFlag("num_workers", FLAGS_num_workers, 0, trainer::kMaxDataLoaderWorkers);
}

int Run() {
  const auto t_start = std::chrono::steady_clock::now();
  trainer::TrainerOptions o;
  const examples::ProcessPlan plan = examples::ApplyTrainerFlags(o);  // strategy, devices, accelerator, precision
  const bool rank0 = plan.rank == 0;

  const std::string data_dir = examples::UserPath(FLAGS_data_dir);
  examples::FashionMnist full_train = examples::FashionMnist::Load(data_dir, "train");
  examples::FashionMnist test = examples::FashionMnist::Load(data_dir, "test");
  examples::CheckIntFlag("val_size", FLAGS_val_size, 0, full_train.size() - 1);
  const int64_t n_train = full_train.size() - FLAGS_val_size;
  examples::FashionMnist train(full_train.images().slice(0, 0, n_train), full_train.labels().slice(0, 0, n_train));
  examples::FashionMnist val(full_train.images().slice(0, n_train), full_train.labels().slice(0, n_train));

  o.max_epochs = FLAGS_max_epochs;
  o.max_steps = FLAGS_max_steps;
  o.batch_size = FLAGS_batch_size;
  o.val_batch_size = 500;
  o.log_every_n_steps = FLAGS_log_every_n_steps;
  o.default_root_dir = FLAGS_default_root_dir.empty() ? examples::UserPath(".") : examples::UserPath(FLAGS_default_root_dir);
  o.seed = FLAGS_seed;
  o.sync_batchnorm = FLAGS_sync_batchnorm;
  o.num_workers = FLAGS_num_workers;
  o.callbacks = {std::make_shared<ReportCallback>()};
  const std::string ckpt = examples::ResolveCheckpointPath(FLAGS_ckpt_path, o.default_root_dir, o.logger_name);
  trainer::Trainer trainer(o);  // validates strategy name, options and precision

  examples::CnnConfig cfg;
  cfg.dropout = FLAGS_dropout;
  // The schedule spans the whole run (Lightning's estimated_stepping_batches).
  const int64_t total_steps = trainer.estimated_stepping_batches(train);
  ST_CHECK_ARG(FLAGS_lr_schedule == "constant" || total_steps > 0,
               "--lr_schedule=cosine needs a finite run (--max_epochs or --max_steps); use --lr_schedule=constant");
  FashionMnistModule module(cfg, FLAGS_lr, FLAGS_lr_schedule == "cosine" ? total_steps : 0);
  if (rank0) {
    std::printf("ShardTrain Fashion-MNIST: CNN (conv %ld-%ld, fc %ld), strategy %s, %d rank(s)%s, %s, %ld train / %ld "
                "val / %ld test images from %s\n",
                static_cast<long>(cfg.channels1), static_cast<long>(cfg.channels2), static_cast<long>(cfg.hidden),
                FLAGS_strategy.c_str(), plan.devices * plan.num_nodes, plan.external ? (" via " + plan.source).c_str() : "",
                FLAGS_precision.c_str(), static_cast<long>(train.size()), static_cast<long>(val.size()),
                static_cast<long>(test.size()), data_dir.c_str());
    if (!ckpt.empty()) std::printf("resuming from %s\n", ckpt.c_str());
    std::fflush(stdout);
  }
  const double fit_secs = examples::TimedFit(trainer, module, train, val.size() > 0 ? &val : nullptr, ckpt);

  // test_loss and test_acc over the 10 000 test images, logged at the last step.
  const std::map<std::string, double> metrics = trainer.Test(module, test);
  if (rank0) {
    std::ostringstream classes;
    const auto& per_class = module.test_per_class();
    for (size_t c = 0; c < per_class.size(); ++c) {
      classes << (c ? ", " : "") << examples::kFashionMnistClasses[c] << Fmt(" %.1f%%", 100.0 * per_class[c]);
    }
    const double total_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::printf("per class: %s\n", classes.str().c_str());
    std::printf("test accuracy: %.2f%% (%ld/%ld), test loss %.4f after %ld epoch(s), %ld steps; fit %.0f s, total %.0f s\n",
                100.0 * metrics.at("test_acc"), static_cast<long>(module.test_correct()),
                static_cast<long>(module.test_total()), metrics.at("test_loss"),
                static_cast<long>(trainer.current_epoch()), static_cast<long>(trainer.global_step()), fit_secs,
                total_secs);
    examples::PrintOutputPaths(trainer);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return shardtrain::examples::RunExampleMain(
      argc, argv, "train a CNN on Fashion-MNIST with the ShardTrain Trainer: train --strategy=fsdp_native --devices=2",
      Run, CheckFlags);
}
