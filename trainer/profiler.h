// Deprecated: moved to trainer/profilers/profiler.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_PROFILER_H_
#define SHARDTRAIN_TRAINER_PROFILER_H_

#include "trainer/profilers/profiler.h"

#endif  // SHARDTRAIN_TRAINER_PROFILER_H_
