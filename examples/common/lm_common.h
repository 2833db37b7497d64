// Pieces the language-model examples (examples/gpt, examples/llama) share:
// the training text (a file or Debian's fortunes), fixed-length windows of a
// token stream as a Dataset, AdamW with the examples' learning-rate
// schedules, and the validation-loss lines printed during Fit.
#ifndef SHARDTRAIN_EXAMPLES_COMMON_LM_COMMON_H_
#define SHARDTRAIN_EXAMPLES_COMMON_LM_COMMON_H_

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "trainer/callbacks/callback.h"
#include "trainer/data/data.h"
#include "trainer/training_module.h"

namespace shardtrain::examples {

// The text of `path`, or with an empty path the English quotations of
// Debian's `fortunes` package; throws InvalidArgumentError saying what to do.
std::string ReadCorpus(const std::string& path);

// Sample i: tokens[starts[i] .. starts[i] + block) and, as targets, the
// tokens after each of them.
class WindowDataset : public trainer::Dataset {
 public:
  WindowDataset(at::Tensor tokens, std::vector<int64_t> starts, int64_t block);
  // Non-overlapping windows covering `tokens`.
  static WindowDataset Tiled(const at::Tensor& tokens, int64_t block);
  // `n` windows spread evenly over `tokens`.
  static WindowDataset Spread(const at::Tensor& tokens, int64_t block, int64_t n);
  int64_t size() const override { return static_cast<int64_t>(starts_.size()); }
  trainer::Batch get_batch(const std::vector<int64_t>& indices) const override;

 private:
  at::Tensor tokens_;
  std::vector<int64_t> starts_;
  int64_t block_;
};

// AdamW and the examples' --lr_scheduler: "none", "cosine" (linear warmup,
// then cosine to lr/10 at total_steps) or "onecycle"; warmup_steps -1 is the
// default (10% of the run for cosine, onecycle's own 30%).
struct LmOptimizerOptions {
  double lr = 3e-3;
  double weight_decay = 0.01;
  std::string schedule = "none";
  int64_t warmup_steps = -1;
  int64_t total_steps = 0;
  // The warmup steps the schedule uses (the -1 default resolved).
  int64_t ResolvedWarmup() const;
};
trainer::OptimizerConfig MakeLmOptimizer(const std::vector<at::Tensor>& params, const LmOptimizerOptions& options);

// "%.4f"-style formatting of one or two numbers.
std::string Fmt(const char* format, double a, double b = 0);

// Prints each validation loss (rank 0) as it is computed during Fit.
class ValLossPrinter : public trainer::Callback {
 public:
  void on_fit_start(trainer::Trainer&, trainer::TrainingModule&) override;
  void on_validation_end(trainer::Trainer& trainer, trainer::TrainingModule&) override;
  int64_t last_step() const { return last_step_; }

 private:
  std::chrono::steady_clock::time_point t0_;
  int64_t last_step_ = -1;
};

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_COMMON_LM_COMMON_H_
