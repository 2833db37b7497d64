// Memory benchmark, ShardTrain side: the examples/gpt model trained through
// the Trainer, with the peak resident set size (VmHWM) of this rank's process
// recorded for each phase; the peak is reset between phases by writing "5" to
// /proc/self/clear_refs. Each rank appends one JSON line per phase to --out.
// bench/memory/run.sh runs it next to Python PyTorch (torch_memory.py).
//
//   memory_bench --mode=train --devices=W --dir=D --out=F      construction, step, full save, sharded save
//   memory_bench --mode=load_full --devices=W --dir=D --out=F  construction, full load (D/full.ckpt)
//   memory_bench --mode=load_sharded ...                       construction, sharded load (D/sharded)
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gflags/gflags.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "base/errors.h"
#include "examples/common/example_util.h"
#include "examples/common/trainer_flags.h"
#include "examples/gpt/gpt_model.h"
#include "strategies/sharded_strategy_base.h"
#include "trainer/trainer.h"

DEFINE_string(mode, "train", "train | load_full | load_sharded");
DEFINE_string(dir, "", "checkpoints are written to / read from here (full.ckpt, sharded/)");
DEFINE_string(out, "", "append one JSON line per rank and phase to this file");
DEFINE_string(label, "", "model label in the output");
DEFINE_bool(sharded_construction, true, "build the model under the strategy's ShardedInitScope");
DEFINE_int32(n_layer, 16, "");
DEFINE_int32(n_embd, 1024, "");
DEFINE_int32(n_head, 16, "");
DEFINE_int32(block_size, 32, "tokens per sequence");
DEFINE_int32(vocab, 96, "");
DEFINE_int32(steps, 1, "training steps");

namespace {
using namespace shardtrain;

int64_t StatusKb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size()));
  }
  return -1;
}

void ResetPeak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.close();
  ST_CHECK_ARG(f, "cannot write /proc/self/clear_refs (needed to reset VmHWM between phases)");
}

int g_rank = 0, g_world = 1;
int64_t g_baseline_kb = 0;

void Record(const std::string& phase) {
  const int64_t peak = StatusKb("VmHWM");
  std::ostringstream s;
  s << "{\"impl\":\"shardtrain\",\"model\":\"" << FLAGS_label << "\",\"W\":" << g_world << ",\"rank\":" << g_rank
    << ",\"phase\":\"" << phase << "\",\"peak_mib\":" << peak / 1024.0 << ",\"baseline_mib\":" << g_baseline_kb / 1024.0
    << "}\n";
  const std::string line = s.str();
  const int fd = ::open(FLAGS_out.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
  ST_CHECK_ARG(fd >= 0, "cannot open --out=", FLAGS_out);
  ST_CHECK_ARG(::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()), "short write to ", FLAGS_out);
  ::close(fd);
  ResetPeak();
}

class GptModule : public trainer::TrainingModule {
 public:
  explicit GptModule(examples::GptConfig c) : config_(c) {}
  std::shared_ptr<torch::nn::Module> configure_model() override {
    model_ = std::make_shared<examples::GptImpl>(config_);
    return model_;
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    return examples::GptImpl::Loss(forward([&] { return model_->forward(b.inputs); }), b.targets);
  }
  trainer::OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    Record("construction");  // model built and sharded; the optimizer's state comes at the first step
    return {std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4))};
  }
  void on_fit_start() override {
    if (FLAGS_mode != "train") Record(FLAGS_mode == "load_full" ? "full_load" : "sharded_load");
  }
  void on_fit_end() override {
    if (FLAGS_mode == "train") Record("step");
  }

 private:
  examples::GptConfig config_;
  std::shared_ptr<examples::GptImpl> model_;
};

int Run() {
  ST_CHECK_ARG(FLAGS_mode == "train" || FLAGS_mode == "load_full" || FLAGS_mode == "load_sharded",
               "--mode must be train, load_full or load_sharded, got '", FLAGS_mode, "'");
  ST_CHECK_ARG(!FLAGS_dir.empty() && !FLAGS_out.empty(), "--dir and --out are required");
  g_baseline_kb = StatusKb("VmRSS");
  trainer::TrainerOptions o;
  const examples::ProcessPlan plan = examples::ApplyTrainerFlags(o);
  g_rank = plan.rank;
  g_world = plan.devices;
  examples::GptConfig c;
  c.vocab_size = FLAGS_vocab;
  c.block_size = FLAGS_block_size;
  c.n_layer = FLAGS_n_layer;
  c.n_head = FLAGS_n_head;
  c.n_embd = FLAGS_n_embd;
  o.max_epochs = -1;
  o.max_steps = FLAGS_steps;
  o.batch_size = 1;
  o.shuffle = false;
  o.enable_checkpointing = false;
  o.enable_logger = false;
  o.enable_progress_bar = false;
  o.default_root_dir = FLAGS_dir;
  o.seed = 1;
  const int64_t n = 64;
  at::Tensor tokens = at::randint(FLAGS_vocab, {n, FLAGS_block_size + 1}, at::kLong);
  trainer::TensorDataset data(tokens.slice(1, 0, FLAGS_block_size).contiguous(), tokens.slice(1, 1).contiguous());
  trainer::Trainer t(o);
  if (auto* s = dynamic_cast<strategies::ShardedStrategyBase*>(&t.strategy())) {
    s->set_sharded_construction(FLAGS_sharded_construction);
  }
  GptModule module(c);
  ResetPeak();
  if (FLAGS_mode == "train") {
    t.Fit(module, data);
    t.SaveCheckpoint(FLAGS_dir + "/full.ckpt", trainer::CheckpointFormat::kFull);
    Record("full_save");
    t.SaveCheckpoint(FLAGS_dir + "/sharded", trainer::CheckpointFormat::kSharded);
    Record("sharded_save");
  } else {
    t.Fit(module, data, nullptr, FLAGS_dir + (FLAGS_mode == "load_full" ? "/full.ckpt" : "/sharded"));
  }
  if (plan.rank == 0) std::printf("%s: %s done at W=%d\n", FLAGS_label.c_str(), FLAGS_mode.c_str(), plan.devices);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return shardtrain::examples::RunExampleMain(argc, argv, "memory per phase: memory_bench --mode=train --devices=2 ...",
                                              Run);
}
