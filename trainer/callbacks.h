// Deprecated: split into trainer/callbacks/ (docs/migration.md): callback.h
// (the Callback base), model_checkpoint.h, learning_rate_monitor.h,
// early_stopping.h. This forwarding header stays for one release.
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_H_

#include "trainer/callbacks/callback.h"
#include "trainer/callbacks/early_stopping.h"
#include "trainer/callbacks/learning_rate_monitor.h"
#include "trainer/callbacks/model_checkpoint.h"

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_H_
