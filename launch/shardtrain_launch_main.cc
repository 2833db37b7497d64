// shardtrain_launch: runs N local ranks of a program as children, with
// torchrun-style variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// GROUP_RANK, MASTER_ADDR, MASTER_PORT, SHARDTRAIN_LAUNCHED=1). Forwards
// SIGINT/SIGTERM to the ranks (a second one sends SIGKILL); when a rank fails
// the others are terminated and the launcher exits 1 naming the failed rank.
//
//   shardtrain_launch --nproc 4 [--master_addr A] [--master_port P]
//                     [--kill_grace_ms MS] -- prog args...
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "base/errors.h"
#include "launch/launcher.h"

namespace {

constexpr const char* kUsage =
    "usage: shardtrain_launch --nproc N [--master_addr ADDR] [--master_port PORT] [--kill_grace_ms MS]\n"
    "                         -- PROGRAM [ARGS...]\n"
    "Runs N local ranks of PROGRAM (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,\n"
    "MASTER_ADDR, MASTER_PORT and SHARDTRAIN_LAUNCHED=1 set). master_port 0 (default) picks a free\n"
    "port. Exits 0 when every rank exits 0; 1 when a rank fails (the others are terminated);\n"
    "128+signal after a forwarded SIGINT/SIGTERM.\n";

int ParseIntFlag(const std::string& name, const std::string& value) {
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || v < 0 || v > 1000000000) {
    ST_THROW(InvalidArgumentError, "shardtrain_launch: --", name, "='", value, "' is not a non-negative integer");
  }
  return static_cast<int>(v);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    shardtrain::LaunchOptions options;
    options.current_process_is_rank0 = false;
    options.num_ranks = 0;
    int i = 1;
    for (; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "--") {
        ++i;
        break;
      }
      if (arg == "-h" || arg == "--help") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      if (arg.rfind("--", 0) != 0) break;  // first program argument
      std::string name = arg.substr(2), value;
      size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else {
        if (i + 1 >= argc) ST_THROW(InvalidArgumentError, "shardtrain_launch: --", name, " needs a value");
        value = argv[++i];
      }
      if (name == "nproc" || name == "nproc_per_node") {
        options.num_ranks = ParseIntFlag(name, value);
      } else if (name == "master_addr") {
        options.master_addr = value;
      } else if (name == "master_port") {
        options.master_port = ParseIntFlag(name, value);
      } else if (name == "kill_grace_ms") {
        options.kill_grace = std::chrono::milliseconds(ParseIntFlag(name, value));
      } else {
        ST_THROW(InvalidArgumentError, "shardtrain_launch: unknown flag --", name,
                 "; valid: --nproc, --master_addr, --master_port, --kill_grace_ms");
      }
    }
    for (; i < argc; ++i) options.argv.push_back(argv[i]);
    if (options.num_ranks < 1) ST_THROW(InvalidArgumentError, "shardtrain_launch: --nproc N (N >= 1) is required");
    if (options.argv.empty()) ST_THROW(InvalidArgumentError, "shardtrain_launch: no program given after --");

    shardtrain::LocalLauncher launcher(options);
    launcher.Start();
    return launcher.Join(0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n%s", e.what(), kUsage);
    return 2;
  }
}
