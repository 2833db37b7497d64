// LaunchLocalRanks and JoinLocalRanks: the process-wide local launch (one
// LocalLauncher per process, started by rank 0, joined at its exit).
#include "launch/launcher.h"

#include <cstdlib>
#include <string>

#include "base/errors.h"

namespace shardtrain {

namespace {
LocalLauncher* g_process_launcher = nullptr;  // leaked on purpose: lives until exit
}  // namespace

int LaunchLocalRanks(const LaunchOptions& options) {
  const char* launched = std::getenv(kLaunchedEnvVar);
  if (launched != nullptr && std::string(launched) == "1") {
    const char* rank = std::getenv("RANK");
    ST_CHECK_ARG(rank != nullptr, kLaunchedEnvVar, "=1 but RANK is not set");
    char* end = nullptr;
    long value = std::strtol(rank, &end, 10);
    ST_CHECK_ARG(end != rank && *end == '\0' && value >= 0, "RANK='", rank, "' is not a rank (", kLaunchedEnvVar,
                 "=1)");
    return static_cast<int>(value);
  }
  ST_CHECK_ARG(options.current_process_is_rank0,
               "LaunchLocalRanks: current_process_is_rank0 must be true (use LocalLauncher otherwise)");
  ST_CHECK_ARG(g_process_launcher == nullptr, "LaunchLocalRanks was already called in this process");
  auto* launcher = new LocalLauncher(options);
  try {
    launcher->Start();
  } catch (...) {
    delete launcher;
    throw;
  }
  launcher->MonitorInBackground();
  g_process_launcher = launcher;
  return 0;
}

int JoinLocalRanks(int rank0_exit_code) {
  if (g_process_launcher == nullptr) return rank0_exit_code;
  return g_process_launcher->Join(rank0_exit_code);
}

}  // namespace shardtrain
