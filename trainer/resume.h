// Deprecated: moved to trainer/checkpoint_io/resume.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_RESUME_H_
#define SHARDTRAIN_TRAINER_RESUME_H_

#include "trainer/checkpoint_io/resume.h"

#endif  // SHARDTRAIN_TRAINER_RESUME_H_
