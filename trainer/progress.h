// Deprecated: moved to trainer/callbacks/progress.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_PROGRESS_H_
#define SHARDTRAIN_TRAINER_PROGRESS_H_

#include "trainer/callbacks/progress.h"

#endif  // SHARDTRAIN_TRAINER_PROGRESS_H_
