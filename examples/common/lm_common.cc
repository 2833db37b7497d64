#include "examples/common/lm_common.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/errors.h"
#include "examples/common/example_util.h"
#include "trainer/optim/lr_scheduler.h"
#include "trainer/trainer.h"

namespace shardtrain::examples {

std::string ReadCorpus(const std::string& path) {
  std::ostringstream text;
  if (!path.empty()) {
    std::ifstream in(path, std::ios::binary);
    ST_CHECK_ARG(in, "cannot read --data=", path, ": give a readable text file");
    text << in.rdbuf();
    return text.str();
  }
  const std::filesystem::path dir = "/usr/share/games/fortunes";
  std::error_code ec;
  ST_CHECK_ARG(std::filesystem::is_directory(dir, ec),
               "no training text: install Debian's `fortunes` package (sudo apt-get install fortunes; "
               "tools/bootstrap.sh does) or pass --data=FILE");
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension().empty()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    text << in.rdbuf();
  }
  return text.str();
}

WindowDataset::WindowDataset(at::Tensor tokens, std::vector<int64_t> starts, int64_t block)
    : tokens_(std::move(tokens)), starts_(std::move(starts)), block_(block) {}

WindowDataset WindowDataset::Tiled(const at::Tensor& tokens, int64_t block) {
  std::vector<int64_t> starts;
  for (int64_t s = 0; s + block + 1 <= tokens.numel(); s += block) starts.push_back(s);
  return WindowDataset(tokens, std::move(starts), block);
}

WindowDataset WindowDataset::Spread(const at::Tensor& tokens, int64_t block, int64_t n) {
  const int64_t last = tokens.numel() - block - 1;
  n = std::max<int64_t>(1, std::min(n, last + 1));
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i) starts.push_back(n == 1 ? 0 : i * last / (n - 1));
  return WindowDataset(tokens, std::move(starts), block);
}

trainer::Batch WindowDataset::get_batch(const std::vector<int64_t>& indices) const {
  std::vector<at::Tensor> xs, ys;
  for (int64_t i : indices) {
    const int64_t s = starts_.at(static_cast<size_t>(i));
    xs.push_back(tokens_.slice(0, s, s + block_));
    ys.push_back(tokens_.slice(0, s + 1, s + block_ + 1));
  }
  return {at::stack(xs), at::stack(ys)};
}

int64_t LmOptimizerOptions::ResolvedWarmup() const {
  return warmup_steps >= 0 ? warmup_steps : (schedule == "cosine" ? total_steps / 10 : 0);
}

trainer::OptimizerConfig MakeLmOptimizer(const std::vector<at::Tensor>& params, const LmOptimizerOptions& o) {
  const double lr = o.lr;
  const int64_t warmup = o.ResolvedWarmup();
  trainer::OptimizerConfig c{
      std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr).weight_decay(o.weight_decay))};
  if (o.schedule == "cosine") {
    auto cosine = std::make_shared<trainer::CosineAnnealingLR>(c.optimizer, o.total_steps - warmup, lr / 10);
    trainer::LRSchedulerPtr s = cosine;
    if (warmup > 0) {
      auto linear = std::make_shared<trainer::LinearLR>(c.optimizer, 1.0 / static_cast<double>(warmup), 1.0, warmup);
      s = std::make_shared<trainer::SequentialLR>(c.optimizer, std::vector<trainer::LRSchedulerPtr>{linear, cosine},
                                                  std::vector<int64_t>{warmup});
    }
    c.lr_schedulers = {{s, "step"}};
  } else if (o.schedule == "onecycle") {
    trainer::OneCycleOptions oc;
    oc.max_lr = lr;
    oc.total_steps = o.total_steps;
    if (warmup > 0) oc.pct_start = static_cast<double>(warmup) / static_cast<double>(o.total_steps);
    c.lr_schedulers = {{std::make_shared<trainer::OneCycleLR>(c.optimizer, oc), "step"}};
  }
  return c;
}

std::string Fmt(const char* format, double a, double b) {
  char buf[128];
  std::snprintf(buf, sizeof(buf), format, a, b);
  return buf;
}

void ValLossPrinter::on_fit_start(trainer::Trainer&, trainer::TrainingModule&) {
  t0_ = std::chrono::steady_clock::now();
}

void ValLossPrinter::on_validation_end(trainer::Trainer& trainer, trainer::TrainingModule&) {
  if (!trainer.fitting()) return;  // Trainer::Validate before/after Fit: the programs print those
  last_step_ = trainer.global_step();
  if (trainer.rank() != 0) return;
  const auto& m = trainer.callback_metrics();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  PrintLine("step " + std::to_string(trainer.global_step()) +
            Fmt(" | val loss %.4f | %.0f s", m.count("val_loss") ? m.at("val_loss") : 0.0, secs));
}

}  // namespace shardtrain::examples
