// Deprecated: moved to trainer/data/data.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_DATA_H_
#define SHARDTRAIN_TRAINER_DATA_H_

#include "trainer/data/data.h"

#endif  // SHARDTRAIN_TRAINER_DATA_H_
