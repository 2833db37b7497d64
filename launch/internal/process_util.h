// Internal to launch/; not part of the public API.
//
// Small process helpers of the local launcher: signal names, how a child
// ended, this process's command line and executable, and PATH lookup.
#ifndef SHARDTRAIN_LAUNCH_INTERNAL_PROCESS_UTIL_H_
#define SHARDTRAIN_LAUNCH_INTERNAL_PROCESS_UTIL_H_

#include <string>
#include <vector>

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

}  // namespace shardtrain::launch_internal

#endif  // SHARDTRAIN_LAUNCH_INTERNAL_PROCESS_UTIL_H_
