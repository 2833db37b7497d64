// Deprecated: moved to trainer/checkpoint_io/archive.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_ARCHIVE_H_
#define SHARDTRAIN_TRAINER_ARCHIVE_H_

#include "trainer/checkpoint_io/archive.h"

#endif  // SHARDTRAIN_TRAINER_ARCHIVE_H_
