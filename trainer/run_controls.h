// Deprecated: moved to trainer/loops/run_controls.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_RUN_CONTROLS_H_
#define SHARDTRAIN_TRAINER_RUN_CONTROLS_H_

#include "trainer/loops/run_controls.h"

#endif  // SHARDTRAIN_TRAINER_RUN_CONTROLS_H_
