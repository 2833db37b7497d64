// Deprecated: moved to trainer/plugins/accelerator.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_ACCELERATOR_H_
#define SHARDTRAIN_TRAINER_ACCELERATOR_H_

#include "trainer/plugins/accelerator.h"

#endif  // SHARDTRAIN_TRAINER_ACCELERATOR_H_
