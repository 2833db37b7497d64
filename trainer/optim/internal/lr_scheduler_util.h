// What trainer/optim/lr_scheduler.cc and lr_scheduler_stateful.cc share: the
// optimizer's registered initial learning rates (PyTorch's
// param_group["initial_lr"]) and typed reads of a scheduler's string state.
// Private to //trainer:lr_scheduler.
#ifndef SHARDTRAIN_TRAINER_OPTIM_INTERNAL_LR_SCHEDULER_UTIL_H_
#define SHARDTRAIN_TRAINER_OPTIM_INTERNAL_LR_SCHEDULER_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/optim/lr_scheduler.h"

namespace shardtrain::trainer::internal {

constexpr double kPi = 3.141592653589793;  // Python's math.pi

// The optimizer's initial learning rates: the first scheduler of an optimizer
// registers its groups' current ones (setdefault), later ones read them;
// `overwrite` replaces them (OneCycleLR).
std::vector<double> InitialLrs(const OptimizerPtr& opt, const std::vector<double>* overwrite);

// `key` of a scheduler state of `type`, as text, an integer or a number;
// InvalidArgumentError naming the type and key when missing or malformed.
std::string Get(const SchedulerState& s, const std::string& key, const std::string& type);
int64_t GetInt(const SchedulerState& s, const std::string& key, const std::string& type);
double GetDouble(const SchedulerState& s, const std::string& key, const std::string& type);

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_OPTIM_INTERNAL_LR_SCHEDULER_UTIL_H_
