// The flags every example program takes to choose how it trains (--strategy,
// --strategy_options, --devices, --accelerator, --precision), defined once
// here, how they become TrainerOptions, and the examples' common main().
#ifndef SHARDTRAIN_EXAMPLES_COMMON_TRAINER_FLAGS_H_
#define SHARDTRAIN_EXAMPLES_COMMON_TRAINER_FLAGS_H_

#include <gflags/gflags.h>

#include "examples/common/example_util.h"
#include "examples/common/flag_checks.h"
#include "trainer/trainer.h"

DECLARE_string(strategy);
DECLARE_string(strategy_options);
DECLARE_string(devices);
DECLARE_string(accelerator);
DECLARE_string(precision);
DECLARE_int64(timeout_s);
DECLARE_int64(stall_warning_s);
DECLARE_int64(stall_timeout_s);
DECLARE_string(resume);
DECLARE_string(profiler);
DECLARE_string(profiler_steps);

namespace shardtrain::examples {

// Resolves --accelerator and --devices (a clear error when what was asked is
// unavailable), plans this process's place in the job (PlanProcesses), gives
// it its share of the cores, and fills the strategy, strategy options,
// accelerator, devices, number of nodes and precision of `options`.
ProcessPlan ApplyTrainerFlags(trainer::TrainerOptions& options);

// Checks the flags above (flag_checks.h): --strategy is a registered name and
// --strategy_options names only its keys, --devices, --accelerator and
// --precision are valid, --timeout_s in [1, 604800], --stall_warning_s and
// --stall_timeout_s in [0, --timeout_s - 1]. Throws FlagError.
void CheckTrainerFlags();

// trainer.Fit(module, train, val, ckpt_path), timed: returns its wall seconds.
double TimedFit(trainer::Trainer& trainer, trainer::TrainingModule& module, const trainer::Dataset& train,
                const trainer::Dataset* val, const std::string& ckpt_path);

// The examples' last lines (rank 0): where the logs and the last checkpoint are.
void PrintOutputPaths(const trainer::Trainer& trainer);

// An example's main(): parses the flags (with `usage`), checks them
// (CheckTrainerFlags, then `check_flags` when given: a FlagError prints
// "error: ..." and exits kUsageErrorExitCode before any rank starts), runs
// `run`, prints "error: ..." for an exception (exit code 1; 2 for a FlagError),
// and in a process that launched local ranks waits for them (JoinLocalRanks:
// non-zero when any failed).
int RunExampleMain(int argc, char** argv, const char* usage, int (*run)(), void (*check_flags)() = nullptr);

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_COMMON_TRAINER_FLAGS_H_
