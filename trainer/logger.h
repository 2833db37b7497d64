// Deprecated: moved to trainer/loggers/logger.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_LOGGER_H_
#define SHARDTRAIN_TRAINER_LOGGER_H_

#include "trainer/loggers/logger.h"

#endif  // SHARDTRAIN_TRAINER_LOGGER_H_
