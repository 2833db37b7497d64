// The profiling connector (trainer/connectors/internal/profiling_connector.h):
// the profiler of one Fit (trainer/profilers/profiler.h).
#include "trainer/connectors/internal/profiling_connector.h"

#include <filesystem>

#include "trainer/trainer.h"

namespace shardtrain::trainer::internal {

void ProfilingConnector::Open() {
  // Every rank writes under the run's directory: the parent of the checkpoint
  // directory, which SetupLoggers agreed on every rank.
  const std::string dir = std::filesystem::path(t_.ckpt_dir_).parent_path().string();
  profiler_ = MakeProfiler(t_.options_.profiler, t_.options_.profiler_steps, dir, t_.rank(), t_.device_.is_cuda());
}

void ProfilingConnector::Close() {
  if (profiler_) profiler_->Close();
}

}  // namespace shardtrain::trainer::internal
