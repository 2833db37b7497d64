// Internal to launch/; not part of the public API.
//
// Small process helpers of the local launcher: signal names, how a child
// ended, this process's command line and executable, PATH lookup, and what a
// rank is started with (its environment, the job's store secret).
#ifndef SHARDTRAIN_LAUNCH_INTERNAL_PROCESS_UTIL_H_
#define SHARDTRAIN_LAUNCH_INTERNAL_PROCESS_UTIL_H_

#include <string>
#include <utility>
#include <vector>

#include "launch/launcher.h"

namespace shardtrain::launch_internal {

// "SIGTERM", ...; "signal N" for others.
std::string SignalName(int sig);

// "exited with code C" / "was killed by signal S (NAME)"; "" for a clean exit.
std::string DescribeFailure(int status);

// This process's argv, from /proc/self/cmdline.
std::vector<std::string> ReadSelfCmdline();

// This process's executable, from /proc/self/exe.
std::string SelfExePath();

// Resolves a program name like execvp does, in the parent (before fork).
// Throws InvalidArgumentError when it is not an executable file or not in PATH.
std::string ResolveProgram(const std::string& program);

// 32 random bytes from the kernel, hex-encoded: the store secret of one job.
std::string NewSecret();

// The variables rank `rank` of a local launch gets (torchrun's names, a
// share of the cores as OMP_NUM_THREADS unless set), then the user's.
std::vector<std::pair<std::string, std::string>> RankEnvironment(const LaunchOptions& o, int rank, int master_port);

// This process's environment ("NAME=value" entries) with `vars` replacing or
// adding entries.
std::vector<std::string> ChildEnvironment(const std::vector<std::pair<std::string, std::string>>& vars);

}  // namespace shardtrain::launch_internal

#endif  // SHARDTRAIN_LAUNCH_INTERNAL_PROCESS_UTIL_H_
