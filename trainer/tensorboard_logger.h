// Deprecated: moved to trainer/loggers/tensorboard_logger.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_TENSORBOARD_LOGGER_H_
#define SHARDTRAIN_TRAINER_TENSORBOARD_LOGGER_H_

#include "trainer/loggers/tensorboard_logger.h"

#endif  // SHARDTRAIN_TRAINER_TENSORBOARD_LOGGER_H_
