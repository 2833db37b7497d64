#include "examples/common/trainer_flags.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "base/errors.h"
#include "base/names.h"
#include "launch/launcher.h"
#include "strategies/registry.h"
#include "trainer/checkpoint_io/resume.h"
#include "trainer/loops/nonfinite.h"
#include "trainer/plugins/accelerator.h"
#include "trainer/profilers/profiler.h"
#include "trainer/stop_signals.h"

DEFINE_string(strategy, "fsdp_native", "strategy by registered name (fsdp_native, fsdp, ddp, single_device, ...)");
DEFINE_string(strategy_options, "",
              "the strategy's options as key=value,key=value (e.g. sharding_strategy=SHARD_GRAD_OP for fsdp_native)");
DEFINE_string(devices, "2",
              "ranks on this machine, or 'auto' (Lightning's devices=auto: every visible GPU with --accelerator=cuda, "
              "1 on cpu); under torchrun/srun/mpirun: taken from the launcher");
DEFINE_string(accelerator, "cpu",
              "cpu, cuda (alias gpu: one rank per GPU, NCCL; needs a --config=cuda build) or auto (cuda when "
              "available, else cpu)");
DEFINE_int64(timeout_s, 1800,
             "seconds a collective or the rendezvous may take before the run fails (TrainerOptions::timeout; "
             "PyTorch's default 30 min); > 0");
DEFINE_int64(stall_warning_s, 60,
             "seconds a collective may wait on a peer that makes no progress (its heartbeat stopped, or it does not "
             "issue the collective) before the waiting rank logs a warning naming it, once per stall "
             "(TrainerOptions::stall_warning; 0: off); 0 or in [1, --timeout_s - 1]");
DEFINE_int64(stall_timeout_s, 0,
             "seconds a collective may wait on a peer that makes no progress before every waiting rank fails "
             "naming it (TrainerOptions::stall_timeout; 0: off, only --timeout_s); 0 or in [1, --timeout_s - 1]; "
             "may be below --stall_warning_s (the failure carries the same report)");
DEFINE_string(nonfinite, "off",
              "off, error (every rank stops naming the step and the first parameter with a NaN/Inf gradient) or "
              "skip (every rank skips that optimizer step) (TrainerOptions::nonfinite)");
DEFINE_string(resume, "never",
              "never, or auto: resume from the newest complete checkpoint under the run's root when one exists "
              "(for requeued SLURM jobs and torchrun --max-restarts; TrainerOptions::resume)");
DEFINE_string(precision, "32-true",
              "32-true, bf16-mixed, 16-mixed or bf16-true (bf16-true: ddp and single_device only)");
DEFINE_string(profiler, "",
              "empty (off), simple (time per phase and communication wait, printed at the end of fit and written to "
              "<log_dir>/profiler-fit.txt) or pytorch (LibTorch's profiler: a Chrome trace per rank in <log_dir>)");
DEFINE_string(profiler_steps, "1:3", "with --profiler=pytorch: wait:active (skip wait training batches, trace active)");

namespace shardtrain::examples {

ProcessPlan ApplyTrainerFlags(trainer::TrainerOptions& options) {
  const std::string accelerator = trainer::ResolveAccelerator(FLAGS_accelerator);
  const ProcessPlan plan =
      PlanProcesses(trainer::ResolveDevices(trainer::ParseDevices(FLAGS_devices), accelerator),
                    !gflags::GetCommandLineFlagInfoOrDie("devices").is_default);
  SetThreadsPerRank(plan.devices);
  options.strategy = FLAGS_strategy;
  options.strategy_options = ParseKeyValueList(FLAGS_strategy_options, "--strategy_options");
  options.accelerator = accelerator;
  options.devices = plan.devices;
  options.num_nodes = plan.num_nodes;
  options.precision = FLAGS_precision;
  options.profiler = FLAGS_profiler;              // checked by the Trainer
  options.profiler_steps = FLAGS_profiler_steps;
  ST_CHECK_ARG(FLAGS_timeout_s > 0 && FLAGS_timeout_s <= 7 * 24 * 3600, "--timeout_s must be in [1, 604800], got ",
               FLAGS_timeout_s);
  options.timeout = std::chrono::seconds(FLAGS_timeout_s);
  options.stall_warning = std::chrono::seconds(FLAGS_stall_warning_s);
  options.stall_timeout = std::chrono::seconds(FLAGS_stall_timeout_s);
  options.nonfinite = FLAGS_nonfinite;
  options.resume = FLAGS_resume;  // checked by the Trainer: never or auto
  return plan;
}

namespace {

// One flag as the Trainer checks it: the flag's name and value, what is
// valid (for the message), and how it sets TrainerOptions.
struct TrainerFlag {
  std::string name;
  std::string value;
  std::string valid;
  std::function<void(trainer::TrainerOptions&)> apply;
};

// Default options with only `flag` applied, through trainer::CheckTrainerOptions:
// its InvalidArgumentError becomes a FlagError naming the flag.
void CheckThroughTrainer(const TrainerFlag& flag) {
  trainer::TrainerOptions options;
  options.accelerator = "cpu";  // the default "auto" is itself checked; --accelerator is checked alone
  flag.apply(options);
  try {
    trainer::CheckTrainerOptions(options);
  } catch (const InvalidArgumentError& e) {
    FailFlag(flag.name, flag.value, flag.valid, e.what());
  }
}

}  // namespace

void CheckTrainerFlags() {
  const std::vector<std::string> names = strategies::StrategyRegistry::Names();
  CheckChoiceFlag("strategy", FLAGS_strategy, names);
  const std::vector<std::string> keys = strategies::StrategyRegistry::ValidKeys(FLAGS_strategy);
  std::string list;
  for (const auto& k : keys) list += (list.empty() ? "" : ", ") + k;
  const std::string valid = "key=value,key=value,... with keys of strategy " + FLAGS_strategy + ": " + list;
  std::map<std::string, std::string> strategy_options;
  try {
    strategy_options = ParseKeyValueList(FLAGS_strategy_options, "--strategy_options");
  } catch (const InvalidArgumentError&) {
    FailFlag("strategy_options", FLAGS_strategy_options, valid, "an entry is not key=value");
  }
  for (const auto& [key, value] : strategy_options) {
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      FailFlag("strategy_options", FLAGS_strategy_options, valid, "unknown key '" + key + "'");
    }
  }
  try {
    trainer::ParseDevices(FLAGS_devices, "devices");
  } catch (const InvalidArgumentError&) {
    FailFlag("devices", FLAGS_devices, "auto or an integer in [1, 99999999] (ranks on this machine)");
  }
  CheckIntFlag("timeout_s", FLAGS_timeout_s, 1, 7 * 24 * 3600);  // before it is turned into milliseconds
  // Below --timeout_s, or the collective's own timeout ends the wait first
  // (the Trainer takes any stall time: its timeout may be set elsewhere).
  CheckIntFlagOr("stall_warning_s", FLAGS_stall_warning_s, 0, "off", 1, FLAGS_timeout_s - 1);
  CheckIntFlagOr("stall_timeout_s", FLAGS_stall_timeout_s, 0, "off", 1, FLAGS_timeout_s - 1);
  // The rest by the Trainer's own option check, one flag at a time, so that
  // the error names the flag; the valid values come from the Trainer's tables.
  const std::string stall_valid = "0 (off) or 1.." + std::to_string(FLAGS_timeout_s - 1) + " (below --timeout_s)";
  const std::vector<TrainerFlag> flags = {
      {"accelerator", FLAGS_accelerator, JoinNames(trainer::AcceleratorNames()),
       [](trainer::TrainerOptions& o) { o.accelerator = FLAGS_accelerator; }},
      {"stall_warning_s", std::to_string(FLAGS_stall_warning_s), stall_valid,
       [](trainer::TrainerOptions& o) {
         o.timeout = std::chrono::seconds(FLAGS_timeout_s);
         o.stall_warning = std::chrono::seconds(FLAGS_stall_warning_s);
       }},
      {"stall_timeout_s", std::to_string(FLAGS_stall_timeout_s), stall_valid,
       [](trainer::TrainerOptions& o) {
         o.timeout = std::chrono::seconds(FLAGS_timeout_s);
         o.stall_timeout = std::chrono::seconds(FLAGS_stall_timeout_s);
       }},
      {"nonfinite", FLAGS_nonfinite, JoinNames(trainer::NonfiniteModes()),
       [](trainer::TrainerOptions& o) { o.nonfinite = FLAGS_nonfinite; }},
      {"resume", FLAGS_resume, JoinNames(trainer::ResumeModes()), [](trainer::TrainerOptions& o) { o.resume = FLAGS_resume; }},
      {"precision", FLAGS_precision, JoinNames(strategies::PrecisionNames()),
       [](trainer::TrainerOptions& o) { o.precision = FLAGS_precision; }},
      {"profiler", FLAGS_profiler, "empty (off), simple or pytorch",
       [](trainer::TrainerOptions& o) { o.profiler = FLAGS_profiler; }},
  };
  for (const auto& f : flags) CheckThroughTrainer(f);
}

double TimedFit(trainer::Trainer& trainer, trainer::TrainingModule& module, const trainer::Dataset& train,
                const trainer::Dataset* val, const std::string& ckpt_path) {
  const auto t0 = std::chrono::steady_clock::now();
  trainer.Fit(module, train, val, ckpt_path);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void PrintOutputPaths(const trainer::Trainer& trainer) {
  std::printf("logs: %s\ncheckpoint: %s\n", trainer.log_dir().c_str(), trainer.last_checkpoint_path().c_str());
  std::fflush(stdout);
}

int RunExampleMain(int argc, char** argv, const char* usage, int (*run)(), void (*check_flags)()) {
  gflags::SetUsageMessage(usage);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  try {
    CheckTrainerFlags();
    if (check_flags != nullptr) check_flags();
  } catch (const FlagError& e) {
    std::fprintf(stderr, "error: %s\n(see --help for every flag and its range)\n", e.what());
    return kUsageErrorExitCode;
  }
  int code = 1;
  try {
    code = run();
  } catch (const trainer::Preempted& e) {
    code = e.exit_code();  // stopped by a signal after saving; rank 0 printed what and how to resume
  } catch (const FlagError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    code = kUsageErrorExitCode;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    code = 1;
  }
  return JoinLocalRanks(code);
}

}  // namespace shardtrain::examples
