// A small real training program for faults_test.sh: the tiny classifier of
// tiny_model.h, fsdp_native, 2 ranks launched by the Trainer itself, a
// checkpoint every 2 steps, a stall timeout of 3 s.
//   fault_worker ROOT MAX_STEPS [auto|never] [full|sharded]
// Rank 0 prints "step N loss L" (L with 17 digits) after each step.
// Environment: FAULT_POINT (forward, backward, optimizer, save), FAULT_SIGNAL
// (KILL or STOP), FAULT_RANK, FAULT_STEP: that rank sends itself the signal
// at that point of global step FAULT_STEP (for "save": the save made after
// FAULT_STEP steps), once, after printing "FAULT rank R SIG at POINT step N
// t_ms=T" on stderr. Every rank whose Fit fails prints "DETECTED rank R
// t_ms=T error: ..." (T: milliseconds of the realtime clock).
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/faults/tiny_model.h"
#include "tests/testing/worker_main.h"
#include "trainer/stop_signals.h"

namespace {
using namespace shardtrain;
using namespace shardtrain::trainer;

long long NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

class Report : public Callback {
 public:
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t) override {
    if (t.rank() != 0) return;
    std::printf("step %lld loss %.17g\n", static_cast<long long>(t.global_step()),
                t.callback_metrics().at("train_loss"));
    std::fflush(stdout);
  }
};

// The hook of FAULT_*: fires once.
faults::FaultHook MakeFaultHook() {
  const std::string point = Env("FAULT_POINT");
  if (point.empty()) return nullptr;
  const std::string sig_name = Env("FAULT_SIGNAL");
  const int sig = sig_name == "STOP" ? SIGSTOP : SIGKILL;
  const int fault_rank = std::atoi(Env("FAULT_RANK").c_str());
  const int64_t fault_step = std::atoll(Env("FAULT_STEP").c_str());
  auto fired = std::make_shared<bool>(false);
  return [=](const std::string& at, int rank, int64_t step) {
    if (*fired || at != point || rank != fault_rank || step != fault_step) return;
    *fired = true;
    std::fprintf(stderr, "FAULT rank %d SIG%s at %s step %lld t_ms=%lld\n", rank, sig_name.c_str(), at.c_str(),
                 static_cast<long long>(step), NowMs());
    std::fflush(stderr);
    raise(sig);
  };
}

int Run(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: fault_worker ROOT MAX_STEPS [auto|never] [full|sharded]\n");
    return 2;
  }
  auto train = faults::TinyData(64, 1);
  faults::TinyModule module;
  module.hook = MakeFaultHook();
  TrainerOptions o;
  o.default_root_dir = argv[1];
  o.max_steps = std::atoi(argv[2]);
  o.resume = argc > 3 ? argv[3] : "never";
  o.devices = 2;
  o.strategy = "fsdp_native";
  if (argc > 4 && std::string(argv[4]) == "sharded") o.strategy_options = {{"state_dict_type", "sharded"}};
  o.batch_size = 8;
  o.log_every_n_steps = 1;
  o.enable_progress_bar = false;
  o.seed = 3;
  o.checkpoint_every_n_steps = 2;
  o.stall_timeout = std::chrono::seconds(3);
  o.timeout = std::chrono::seconds(60);
  o.callbacks = {std::make_shared<Report>(), std::make_shared<faults::SaveHook>(&module)};
  Trainer trainer(o);
  try {
    trainer.Fit(module, *train);
  } catch (const Preempted&) {
    throw;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "DETECTED rank %d t_ms=%lld error: %s\n", trainer.rank(), NowMs(), e.what());
    std::fflush(stderr);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return shardtrain::testing::WorkerMain(Run, argc, argv); }
