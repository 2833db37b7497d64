// Trainer::ProfilingScope: the profiler of one Fit (trainer/profilers/profiler.h).
#include <filesystem>

#include "trainer/trainer.h"

namespace shardtrain::trainer {

Trainer::ProfilingScope::ProfilingScope(Trainer& t) : trainer(t) {
  // Every rank writes under the run's directory: the parent of the checkpoint
  // directory, which SetupLoggers agreed on every rank.
  const std::string dir = std::filesystem::path(t.ckpt_dir_).parent_path().string();
  t.profiler_ = MakeProfiler(t.options_.profiler, t.options_.profiler_steps, dir, t.rank(), t.device_.is_cuda());
}

Trainer::ProfilingScope::~ProfilingScope() {
  if (trainer.profiler_) trainer.profiler_->Close();
}

}  // namespace shardtrain::trainer
