// ShardTrain's side of lightning_interop_test.sh (Python Lightning is the other):
//   lightning_fixture save OUT.ckpt
//     trains Net (below; lightning_interop_check.py has the same in Python)
//     with fsdp_native on 2 threads-as-ranks for 2 epochs and writes a full
//     checkpoint (Lightning's layout).
//   lightning_fixture resume IN.ckpt MAX_EPOCHS LOSSES.txt
//     resumes IN.ckpt (ShardTrain's or Python Lightning's) on one rank, trains
//     to MAX_EPOCHS with the data in order (batches of 8), writes each step's
//     loss, one per line, and checks the restored optimizer lr against the
//     file's.
//   lightning_fixture save_sharded OUT_DIR OUT.ckpt
//     as save, and writes both a sharded (PyTorch DCP) and a full checkpoint
//     of the same state (for dcp_interop_test.sh).
//   lightning_fixture resume_sharded IN W MAX_EPOCHS LOSSES.txt [no_scheduler]
//     as resume, with fsdp_native on W threads-as-ranks (global batches of
//     8); no_scheduler: without the StepLR (for a directory that holds no
//     scheduler state).
//   lightning_fixture save_tp OUT_DIR OUT.ckpt
//     the example GPT (tests/trainer/gpt_module.h) with model_parallel at 2x2
//     (W=4, sequence parallel) for 2 steps: a sharded (DCP) and a full
//     checkpoint of the same state.
//   lightning_fixture resume_tp IN TP LOSSES.txt
//     resumes IN with model_parallel at (4/TP)xTP (global batches of 4) to
//     step 4 and writes each step's loss.
//   lightning_fixture dump IN.ckpt
//     prints what LoadCheckpoint reads (sums of the tensors; for debugging).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <barrier>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <string>

#include "sharding/wrap_point.h"
#include "tests/testing/multi_rank.h"
#include "tests/trainer/gpt_module.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/optim/lr_scheduler.h"
#include "trainer/trainer.h"

namespace {
using namespace shardtrain::trainer;

constexpr int64_t kSamples = 64;

// Every parameter from `g`, in registration order (inside the constructors:
// threads-as-ranks share the global generator, and sharded construction keeps
// only a unit's shard once its constructor returns).
void Draw(torch::nn::Module& m, at::Generator& g) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.copy_(at::randn(p.sizes(), g) * 0.4);
}

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t in, int64_t out, at::Generator* g) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    Draw(*this, *g);
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc->forward(x)); }
  torch::nn::Linear fc{nullptr};
};

class NetImpl : public torch::nn::Module {
 public:
  explicit NetImpl(int64_t width) {
    auto g = at::detail::createCPUGenerator(11);  // the same weights on every rank
    b1 = register_module("b1", std::make_shared<shardtrain::sharding::Sharded<BlockImpl>>(4, width, &g));
    b2 = register_module("b2", std::make_shared<shardtrain::sharding::Sharded<BlockImpl>>(width, width, &g));
    head = register_module("head", torch::nn::Linear(width, 2));
    Draw(*head, g);
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(b2->forward(b1->forward(x))); }
  std::shared_ptr<shardtrain::sharding::Sharded<BlockImpl>> b1, b2;
  torch::nn::Linear head{nullptr};
};

// The same numbers as lightning_interop_check.py's data() (the same torch kernels).
std::shared_ptr<TensorDataset> Data() {
  at::Tensor x = at::sin(at::arange(kSamples * 4, at::kFloat).reshape({kSamples, 4}) * 0.37);
  at::Tensor y = at::stack({x.select(1, 0) * x.select(1, 1), x.select(1, 2) - x.select(1, 3)}, 1);
  return std::make_shared<TensorDataset>(x, y);
}

class Net : public TrainingModule {
 public:
  std::shared_ptr<torch::nn::Module> configure_model() override {
    net_ = std::make_shared<NetImpl>(8);
    return net_;
  }
  at::Tensor training_step(const Batch& b, int64_t) override {
    at::Tensor out = forward([&] { return net_->forward(b.inputs); });
    return at::mse_loss(out, b.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    OptimizerConfig c;
    c.optimizer = std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
    if (scheduler) c.lr_schedulers = {{std::make_shared<StepLR>(c.optimizer, 5, 0.5), "step"}};
    return c;
  }
  bool scheduler = true;
  // Typed, as Lightning's save_hyperparameters() keeps them (Net.__init__'s arguments in Python).
  StateDict hyper_parameters() const override { return {{"width", 8}, {"lr", 0.01}, {"act", "tanh"}, {"bias", true}}; }
  std::shared_ptr<NetImpl> net_;
};

TrainerOptions Options(int world, int64_t max_epochs) {
  TrainerOptions o;
  o.default_root_dir = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/lt_fixture";
  o.max_epochs = max_epochs;
  o.batch_size = 8 / world;
  o.shuffle = false;
  o.enable_progress_bar = false;
  o.enable_checkpointing = false;
  o.enable_logger = false;
  o.enable_model_summary = false;
  o.seed = 5;
  return o;
}

// The full checkpoint `out` and, where `sharded` is given, a sharded one of the same state.
int Save(const std::string& out, const std::string& sharded) {
  auto data = Data();
  TrainerOptions o = Options(2, 2);
  o.strategy = "fsdp_native";
  shardtrain::testing::RunRanks(2, [&](int, const auto& comm) {
    Net module;
    Trainer trainer(o, comm);
    trainer.Fit(module, *data);
    if (!sharded.empty()) trainer.SaveCheckpoint(sharded, CheckpointFormat::kSharded);
    trainer.SaveCheckpoint(out, CheckpointFormat::kFull);
  });
  std::cout << "wrote " << out << (sharded.empty() ? "" : " and " + sharded) << std::endl;
  return 0;
}

void WriteLosses(const std::string& path, const std::vector<double>& losses) {
  std::ofstream f(path);
  f << std::setprecision(17);
  for (double l : losses) f << l << "\n";
}

int ResumeSharded(const std::string& in, int world, int64_t max_epochs, const std::string& losses, bool scheduler) {
  auto data = Data();
  TrainerOptions o = Options(world, max_epochs);
  o.strategy = "fsdp_native";
  std::vector<double> out;
  shardtrain::testing::RunRanks(world, [&](int rank, const auto& comm) {
    Net module;
    module.scheduler = scheduler;
    Trainer trainer(o, comm);
    trainer.Fit(module, *data, nullptr, in);
    if (rank == 0) out = trainer.step_losses();
  });
  WriteLosses(losses, out);
  std::cout << "resumed " << in << " at W=" << world << ": " << out.size() << " losses in " << losses << std::endl;
  return 0;
}

int Resume(const std::string& in, int64_t max_epochs, const std::string& losses) {
  auto data = Data();
  TrainerOptions o = Options(1, max_epochs);
  o.strategy = "single_device";
  Net module;
  Trainer trainer(o);
  trainer.Fit(module, *data, nullptr, in);
  WriteLosses(losses, trainer.step_losses());
  std::cout << "resumed " << in << " to epoch " << trainer.current_epoch() << ", step " << trainer.global_step() << "; "
            << trainer.step_losses().size() << " losses in " << losses << std::endl;
  return 0;
}

// model_parallel at (4 / tp) x tp on the example GPT, global batches of 4 (as model_parallel_trainer_test).
TrainerOptions TpOptions(int tp, int64_t max_steps) {
  TrainerOptions o = Options(1, 1);
  o.max_epochs.reset();
  o.max_steps = max_steps;
  o.batch_size = tp;  // per data-parallel rank: 4 / (4 / tp)
  o.gradient_clip_val = 0.5;
  o.strategy = "model_parallel";
  o.strategy_options = {{"tensor_parallel_size", std::to_string(tp)}};
  return o;
}

// Trains with `o` at W=4 (from `in` if given) and runs `then` on each rank's Trainer; rank 0's losses.
std::vector<double> FitTp(const TrainerOptions& o, const std::string& in,
                          const std::function<void(Trainer&)>& then = nullptr) {
  const TensorDataset data = shardtrain::trainer::testing::SmallGptData();
  std::barrier<> seeded(4);
  std::vector<double> losses;
  shardtrain::testing::RunRanks(4, [&](int rank, const auto& comm) {
    shardtrain::trainer::testing::GptModule module(false, &seeded);
    Trainer trainer(o, comm);
    trainer.Fit(module, data, nullptr, in);
    if (then) then(trainer);
    if (rank == 0) losses = trainer.step_losses();
  });
  return losses;
}

int SaveTp(const std::string& dir, const std::string& full) {
  TrainerOptions o = TpOptions(2, 2);
  o.strategy_options["sequence_parallel"] = "true";
  FitTp(o, "", [&](Trainer& t) {
    t.SaveCheckpoint(dir, CheckpointFormat::kSharded);
    t.SaveCheckpoint(full, CheckpointFormat::kFull);
  });
  std::cout << "model_parallel 2x2: wrote " << dir << " and " << full << std::endl;
  return 0;
}

int ResumeTp(const std::string& in, int tp, const std::string& losses) {
  const std::vector<double> out = FitTp(TpOptions(tp, 4), in);
  WriteLosses(losses, out);
  std::cout << "resumed " << in << " with model_parallel at " << 4 / tp << "x" << tp << ": " << out.size()
            << " losses in " << losses << std::endl;
  return 0;
}

int Dump(const std::string& in) {
  CheckpointData d = LoadCheckpoint(in);
  std::cout << std::setprecision(10);
  for (const auto& [k, t] : d.state_dict)
    std::cout << k << " " << t.sizes() << " sum " << t.sum().item<double>() << "\n";
  for (const auto& [n, keys] : d.optimizer_full.state) {
    for (const auto& [k, t] : keys) std::cout << n << "/" << k << " sum " << t.sum().item<double>() << "\n";
  }
  std::cout << "epoch " << d.epoch << " step " << d.global_step << " batch " << d.batch_in_epoch << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "save" && argc == 3) return Save(argv[2], "");
  if (mode == "dump" && argc == 3) return Dump(argv[2]);
  if (mode == "save_sharded" && argc == 4) return Save(argv[3], argv[2]);
  if (mode == "resume_sharded" && (argc == 6 || (argc == 7 && std::string(argv[6]) == "no_scheduler"))) {
    return ResumeSharded(argv[2], std::stoi(argv[3]), std::stoll(argv[4]), argv[5], argc == 6);
  }
  if (mode == "save_tp" && argc == 4) return SaveTp(argv[2], argv[3]);
  if (mode == "resume_tp" && argc == 5) return ResumeTp(argv[2], std::stoi(argv[3]), argv[4]);
  if (mode == "resume" && argc == 5) return Resume(argv[2], std::stoll(argv[3]), argv[4]);
  std::cerr << "usage: lightning_fixture save OUT.ckpt | resume IN.ckpt MAX_EPOCHS LOSSES.txt" << std::endl;
  return 2;
}
