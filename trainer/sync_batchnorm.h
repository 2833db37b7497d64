// Deprecated: moved to trainer/plugins/sync_batchnorm.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_SYNC_BATCHNORM_H_
#define SHARDTRAIN_TRAINER_SYNC_BATCHNORM_H_

#include "trainer/plugins/sync_batchnorm.h"

#endif  // SHARDTRAIN_TRAINER_SYNC_BATCHNORM_H_
