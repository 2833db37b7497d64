// The flags every example program takes to choose how it trains (--strategy,
// --strategy_options, --devices, --accelerator, --precision), defined once
// here, and how they become TrainerOptions.
#ifndef SHARDTRAIN_EXAMPLES_COMMON_TRAINER_FLAGS_H_
#define SHARDTRAIN_EXAMPLES_COMMON_TRAINER_FLAGS_H_

#include <gflags/gflags.h>

#include "examples/common/example_util.h"
#include "trainer/trainer.h"

DECLARE_string(strategy);
DECLARE_string(strategy_options);
DECLARE_string(devices);
DECLARE_string(accelerator);
DECLARE_string(precision);

namespace shardtrain::examples {

// Resolves --accelerator and --devices (a clear error when what was asked is
// unavailable), plans this process's place in the job (PlanProcesses), gives
// it its share of the cores, and fills the strategy, strategy options,
// accelerator, devices, number of nodes and precision of `options`.
ProcessPlan ApplyTrainerFlags(trainer::TrainerOptions& options);

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_COMMON_TRAINER_FLAGS_H_
