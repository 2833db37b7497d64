// Deprecated: moved to trainer/optim/grad_scaler.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_GRAD_SCALER_H_
#define SHARDTRAIN_TRAINER_GRAD_SCALER_H_

#include "trainer/optim/grad_scaler.h"

#endif  // SHARDTRAIN_TRAINER_GRAD_SCALER_H_
