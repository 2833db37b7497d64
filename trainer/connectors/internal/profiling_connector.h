// Internal to //trainer: the profiling connector — the profiler of one Fit
// (TrainerOptions::profiler; trainer/profilers/profiler.h), made after the
// loggers (it writes in the run's directory) and closed on every exit.
#ifndef SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_PROFILING_CONNECTOR_H_
#define SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_PROFILING_CONNECTOR_H_

#include <memory>

#include "trainer/profilers/profiler.h"

namespace shardtrain::trainer {

class Trainer;

namespace internal {

class ProfilingConnector {
 public:
  explicit ProfilingConnector(Trainer& trainer) : t_(trainer) {}
  ProfilingConnector(const ProfilingConnector&) = delete;
  ProfilingConnector& operator=(const ProfilingConnector&) = delete;

  // Held by Fit: makes the profiler and closes it when it ends.
  class FitScope {
   public:
    explicit FitScope(ProfilingConnector& connector) : connector_(connector) { connector_.Open(); }
    FitScope(const FitScope&) = delete;
    FitScope& operator=(const FitScope&) = delete;
    ~FitScope() { connector_.Close(); }

   private:
    ProfilingConnector& connector_;
  };

  // Times `action` while the returned scope lives (inert when profiling is off).
  ProfileScope Profile(const char* action) { return ProfileScope(profiler_.get(), action); }
  Profiler* profiler() const { return profiler_.get(); }

 private:
  void Open();
  void Close();

  Trainer& t_;
  std::unique_ptr<Profiler> profiler_;
};

}  // namespace internal
}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CONNECTORS_INTERNAL_PROFILING_CONNECTOR_H_
