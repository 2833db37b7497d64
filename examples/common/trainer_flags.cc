#include "examples/common/trainer_flags.h"

#include <cstdio>
#include <exception>

#include "launch/launcher.h"
#include "trainer/accelerator.h"

DEFINE_string(strategy, "fsdp_native", "strategy by registered name (fsdp_native, fsdp, ddp, single_device, ...)");
DEFINE_string(strategy_options, "",
              "the strategy's options as key=value,key=value (e.g. sharding_strategy=SHARD_GRAD_OP for fsdp_native)");
DEFINE_string(devices, "2",
              "ranks on this machine, or 'auto' (Lightning's devices=auto: every visible GPU with --accelerator=cuda, "
              "1 on cpu); under torchrun/srun/mpirun: taken from the launcher");
DEFINE_string(accelerator, "cpu",
              "cpu, cuda (alias gpu: one rank per GPU, NCCL; needs a --config=cuda build) or auto (cuda when "
              "available, else cpu)");
DEFINE_string(precision, "32-true",
              "32-true, bf16-mixed, 16-mixed or bf16-true (bf16-true: ddp and single_device only)");

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
  return plan;
}

int RunExampleMain(int argc, char** argv, const char* usage, int (*run)()) {
  gflags::SetUsageMessage(usage);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  int code = 1;
  try {
    code = run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    code = 1;
  }
  return JoinLocalRanks(code);
}

}  // namespace shardtrain::examples
