// Deprecated: moved to trainer/optim/lr_scheduler.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_LR_SCHEDULER_H_
#define SHARDTRAIN_TRAINER_LR_SCHEDULER_H_

#include "trainer/optim/lr_scheduler.h"

#endif  // SHARDTRAIN_TRAINER_LR_SCHEDULER_H_
