// Small process helpers of the local launcher (see internal/process_util.h).
#include "launch/internal/process_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "base/errors.h"
#include "launch/launcher.h"

extern char** environ;

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

// 32 random bytes from the kernel, hex-encoded: the store secret of one job.
std::string NewSecret() {
  uint8_t bytes[32];
  size_t got = 0;
  const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  while (fd >= 0 && got < sizeof bytes) {
    const ssize_t n = read(fd, bytes + got, sizeof bytes - got);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (fd >= 0) close(fd);
  if (got != sizeof bytes) ST_THROW(Error, "launcher: cannot read 32 bytes from /dev/urandom for the store secret");
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

// The variables rank `rank` gets (torchrun's names), then the user's.
std::vector<std::pair<std::string, std::string>> RankEnvironment(const LaunchOptions& o, int rank, int master_port) {
  std::vector<std::pair<std::string, std::string>> vars = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(o.num_ranks)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.num_ranks)},
      {"GROUP_RANK", "0"},
      {"GROUP_WORLD_SIZE", "1"},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
      {kLaunchedEnvVar, "1"},
  };
  // Like torchrun: unless the user chose, split the cores between the local
  // ranks. OpenMP pools that together exceed the cores spin against each
  // other and against Gloo's I/O threads (measured: a 2-rank step 24x slower).
  if (!std::getenv("OMP_NUM_THREADS")) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    vars.emplace_back("OMP_NUM_THREADS", std::to_string(std::max(1u, cores / static_cast<unsigned>(o.num_ranks))));
  }
  vars.insert(vars.end(), o.env.begin(), o.env.end());
  return vars;
}

// This process's environment ("NAME=value" entries) with `vars` replacing or
// adding entries.
std::vector<std::string> ChildEnvironment(const std::vector<std::pair<std::string, std::string>>& vars) {
  std::map<std::string, std::string> overrides;
  for (const auto& [name, value] : vars) overrides[name] = value;
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    if (overrides.count(name) == 0) env.push_back(std::move(entry));
  }
  for (const auto& [name, value] : overrides) env.push_back(name + "=" + value);
  return env;
}

}  // namespace shardtrain::launch_internal

namespace shardtrain {

int PickFreePort(const std::string& addr) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) ST_THROW(Error, "launcher: socket() failed while picking a free port: ", std::strerror(errno));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  std::string host = addr == "localhost" ? "127.0.0.1" : addr;
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) sa.sin_addr.s_addr = htonl(INADDR_ANY);
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    int err = errno;
    close(fd);
    ST_THROW(Error, "launcher: cannot bind a free port on ", addr, ": ", std::strerror(err));
  }
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  close(fd);
  return ntohs(sa.sin_port);
}

}  // namespace shardtrain
