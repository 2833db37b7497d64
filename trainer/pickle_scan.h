// Deprecated: moved to trainer/checkpoint_io/pickle_scan.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_PICKLE_SCAN_H_
#define SHARDTRAIN_TRAINER_PICKLE_SCAN_H_

#include "trainer/checkpoint_io/pickle_scan.h"

#endif  // SHARDTRAIN_TRAINER_PICKLE_SCAN_H_
