// Users' code keeps building for one release after the trainer/ move
// (docs/migration.md): every old header path still compiles through its old
// label, and the names it gave are still there. Compiled by `bazel build //...`
// (a library: nothing to run); Bazel prints each old label's deprecation.
#include "trainer/accelerator.h"
#include "trainer/archive.h"
#include "trainer/callbacks.h"
#include "trainer/checkpoint.h"
#include "trainer/csv_logger.h"
#include "trainer/data.h"
#include "trainer/data_loader.h"
#include "trainer/file_util.h"
#include "trainer/grad_scaler.h"
#include "trainer/logger.h"
#include "trainer/lr_scheduler.h"
#include "trainer/model_summary.h"
#include "trainer/nonfinite.h"
#include "trainer/pickle_scan.h"
#include "trainer/profiler.h"
#include "trainer/progress.h"
#include "trainer/resume.h"
#include "trainer/run_controls.h"
#include "trainer/sharded_checkpoint.h"
#include "trainer/sync_batchnorm.h"
#include "trainer/tensorboard_logger.h"

namespace shardtrain::trainer {

// The names users spelled with the old headers, still in namespace trainer.
[[maybe_unused]] void (*const kWriteFileAtomically)(const std::string&, const std::string&) = &WriteFileAtomically;
[[maybe_unused]] constexpr auto kModelCheckpointSize = sizeof(ModelCheckpoint);
[[maybe_unused]] constexpr auto kEarlyStoppingSize = sizeof(EarlyStopping);
[[maybe_unused]] constexpr auto kCsvLoggerSize = sizeof(CsvLogger);

}  // namespace shardtrain::trainer
