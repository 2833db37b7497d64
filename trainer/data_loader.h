// Deprecated: moved to trainer/data/data_loader.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_DATA_LOADER_H_
#define SHARDTRAIN_TRAINER_DATA_LOADER_H_

#include "trainer/data/data_loader.h"

#endif  // SHARDTRAIN_TRAINER_DATA_LOADER_H_
