// A small real training program for preemption_test.sh: the fixtures'
// classifier, fsdp_native, 2 ranks (launched by the Trainer itself, or by
// torchrun), a checkpoint every 2 steps, 3 epochs of 4 steps.
//   preempt_worker ROOT MAX_STEPS [auto]     (auto: TrainerOptions::resume)
// Rank 0 prints "attempt A step N loss L" (L with 17 digits) after each step.
// Environment: PREEMPT_SLEEP_MS: sleep after each step (time to send a
// signal; only on rank PREEMPT_SLEEP_RANK when set); PREEMPT_TIMEOUT_MS:
// TrainerOptions::timeout; PREEMPT_KILL_RANK / PREEMPT_KILL_STEP: that rank SIGKILLs itself
// after that step on the first attempt (TORCHELASTIC_RESTART_COUNT unset or 0);
// PREEMPT_ASYNC=1: sharded checkpoints written in the background (async_checkpoint);
// PREEMPT_MODEL_PARALLEL=1: the example GPT (tests/trainer/gpt_module.h) with
// model_parallel at tensor_parallel_size=2 instead (both ranks one tensor-parallel
// group), its checkpoints sharded (DCP, save_distributed_checkpoint).
#include <signal.h>

#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "tests/testing/worker_main.h"
#include "tests/trainer/fixtures.h"
#include "tests/trainer/gpt_module.h"

namespace {
using namespace shardtrain::trainer;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

class Report : public Callback {
 public:
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t) override {
    const int attempt = EnvInt("TORCHELASTIC_RESTART_COUNT", 0);
    if (t.rank() == 0) {
      std::printf("attempt %d step %lld loss %.17g\n", attempt, static_cast<long long>(t.global_step()),
                  t.callback_metrics().at("train_loss"));
      std::fflush(stdout);
    }
    if (attempt == 0 && t.rank() == EnvInt("PREEMPT_KILL_RANK", -1) &&
        t.global_step() == EnvInt("PREEMPT_KILL_STEP", -1)) {
      raise(SIGKILL);
    }
    const int sleeper = EnvInt("PREEMPT_SLEEP_RANK", -1);
    if (sleeper < 0 || sleeper == t.rank()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(EnvInt("PREEMPT_SLEEP_MS", 0)));
    }
  }
};

int Run(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: preempt_worker ROOT MAX_STEPS [auto]\n");
    return 2;
  }
  const bool model_parallel = EnvInt("PREEMPT_MODEL_PARALLEL", 0) == 1;
  TrainerOptions o = fixtures::BaseOptions(argv[1], 2);
  o.devices = 2;
  o.strategy = "fsdp_native";
  o.max_steps = std::atoi(argv[2]);
  o.checkpoint_every_n_steps = 2;
  o.resume = argc > 3 ? argv[3] : "never";
  o.callbacks = {std::make_shared<Report>()};
  o.timeout = std::chrono::milliseconds(EnvInt("PREEMPT_TIMEOUT_MS", 1800 * 1000));
  if (EnvInt("PREEMPT_ASYNC", 0) == 1) {
    o.strategy_options = {{"state_dict_type", "sharded"}};
    o.async_checkpoint = true;
  }
  if (model_parallel) {
    o.strategy = "model_parallel";
    o.strategy_options = {{"tensor_parallel_size", "2"}, {"save_distributed_checkpoint", "true"}};
    o.max_epochs.reset();  // max_steps decides: 8 steps per epoch of the 16 sequences
    o.batch_size = 2;
    std::barrier<> seeded(1);  // one rank per process
    shardtrain::trainer::testing::GptModule module(false, &seeded);
    Trainer trainer(o);
    trainer.Fit(module, shardtrain::trainer::testing::SmallGptData());
    return 0;
  }
  auto train = fixtures::MakeData(64, 1);
  fixtures::Classifier module;
  Trainer trainer(o);
  trainer.Fit(module, *train);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return shardtrain::testing::WorkerMain(Run, argc, argv); }
