// Deprecated: moved to trainer/callbacks/model_summary.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_MODEL_SUMMARY_H_
#define SHARDTRAIN_TRAINER_MODEL_SUMMARY_H_

#include "trainer/callbacks/model_summary.h"

#endif  // SHARDTRAIN_TRAINER_MODEL_SUMMARY_H_
