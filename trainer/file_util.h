// Deprecated: moved to base/file_util.h (docs/migration.md). This forwarding header
// stays for one release; include the new path.
#ifndef SHARDTRAIN_TRAINER_FILE_UTIL_H_
#define SHARDTRAIN_TRAINER_FILE_UTIL_H_

#include "base/file_util.h"

namespace shardtrain::trainer {
using ::shardtrain::LinkFileAtomically;
using ::shardtrain::RemoveStaleTemporaries;
using ::shardtrain::TemporaryBeside;
using ::shardtrain::WriteFileAtomically;
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_FILE_UTIL_H_
