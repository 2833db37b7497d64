// Small process helpers of the local launcher (see internal/process_util.h).
#include "launch/internal/process_util.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "base/errors.h"

namespace shardtrain::launch_internal {

std::string SignalName(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    default: return "signal " + std::to_string(sig);
  }
}

// "exited with code C" / "was killed by signal S (NAME)"; "" for a clean exit.
std::string DescribeFailure(int status) {
  if (WIFEXITED(status)) {
    int code = WEXITSTATUS(status);
    return code == 0 ? "" : "exited with code " + std::to_string(code);
  }
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + SignalName(sig) + ")";
  }
  return "ended with wait status " + std::to_string(status);
}

std::vector<std::string> ReadSelfCmdline() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::string cur;
  for (char ch : data) {
    if (ch == '\0') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(ch);
    }
  }
  if (!cur.empty()) args.push_back(cur);
  return args;
}

std::string SelfExePath() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "/proc/self/exe";
  buf[n] = '\0';
  return buf;
}

// Resolves a program name like execvp does, in the parent (before fork).
std::string ResolveProgram(const std::string& program) {
  ST_CHECK_ARG(!program.empty(), "launcher: the program to run is empty");
  if (program.find('/') != std::string::npos) {
    ST_CHECK_ARG(access(program.c_str(), X_OK) == 0, "launcher: program '", program,
                 "' is not an executable file: ", std::strerror(errno));
    return program;
  }
  const char* path_env = std::getenv("PATH");
  std::string path = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  ST_THROW(InvalidArgumentError, "launcher: program '", program, "' not found in PATH=", path);
}

}  // namespace shardtrain::launch_internal
