// Deprecated: moved to trainer/loops/nonfinite.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_NONFINITE_H_
#define SHARDTRAIN_TRAINER_NONFINITE_H_

#include "trainer/loops/nonfinite.h"

#endif  // SHARDTRAIN_TRAINER_NONFINITE_H_
