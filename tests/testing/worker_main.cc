#include "tests/testing/worker_main.h"

#include <cstdio>
#include <exception>

#include "launch/launcher.h"
#include "trainer/stop_signals.h"

namespace shardtrain::testing {

int WorkerMain(int (*run)(int argc, char** argv), int argc, char** argv) {
  int code = 1;
  try {
    code = run(argc, argv);
  } catch (const trainer::Preempted& e) {
    code = e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return JoinLocalRanks(code);
}

}  // namespace shardtrain::testing
