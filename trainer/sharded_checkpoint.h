// Deprecated: moved to trainer/checkpoint_io/sharded_checkpoint.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_SHARDED_CHECKPOINT_H_
#define SHARDTRAIN_TRAINER_SHARDED_CHECKPOINT_H_

#include "trainer/checkpoint_io/sharded_checkpoint.h"

#endif  // SHARDTRAIN_TRAINER_SHARDED_CHECKPOINT_H_
