// A fake rank for launcher_test. Prints its RANK, records what it saw in
// $HELPER_OUT_DIR/rank_<R>.txt, then behaves as the environment says:
//   HELPER_EXIT_CODES=0,3,0   exit code of each rank (missing: 0)
//   HELPER_HANG_RANKS=1,2     these ranks sleep (up to 60 s) instead of exiting
//   HELPER_KILL_SELF_RANK=2   this rank kills itself with SIGKILL
//   HELPER_SYNC=1             first wait (up to 5 s) until every rank has
//                             written its report, i.e. installed its handlers
// On SIGTERM/SIGINT it writes $HELPER_OUT_DIR/signal_rank_<R> and dies by the
// signal. With --self_launch=N it first calls LaunchLocalRanks (it is then a
// trainer that re-executes itself for ranks 1..N-1) and rank 0 ends with
// JoinLocalRanks.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "launch/cluster_environment.h"
#include "launch/launcher.h"

namespace {

std::atomic<int> g_rank{-1};
char g_out_dir[4096];

std::string Env(const char* name, const char* fallback = "") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

std::vector<int> IntList(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(std::atoi(item.c_str()));
  }
  return out;
}

void OnSignal(int sig) {
  // Async-signal-safe: build the path by hand, open, write, re-raise.
  char path[4200];
  int rank = g_rank.load();
  size_t n = std::strlen(g_out_dir);
  std::memcpy(path, g_out_dir, n);
  const char* suffix = "/signal_rank_";
  std::memcpy(path + n, suffix, std::strlen(suffix));
  n += std::strlen(suffix);
  if (rank < 0) {
    path[n++] = 'x';
  } else {
    char digits[16];
    int d = 0;
    do {
      digits[d++] = static_cast<char>('0' + rank % 10);
      rank /= 10;
    } while (rank > 0);
    while (d > 0) path[n++] = digits[--d];
  }
  path[n] = '\0';
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    char buf[4] = {static_cast<char>('0' + sig / 10), static_cast<char>('0' + sig % 10), '\n', 0};
    ssize_t ignored = write(fd, buf, 3);
    (void)ignored;
    close(fd);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

void WriteReport(int rank) {
  std::string dir = g_out_dir;
  std::ostringstream os;
  for (const char* name : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                           "MASTER_PORT", "SHARDTRAIN_LAUNCHED", "HELPER_EXTRA"}) {
    os << name << "=" << Env(name, "<unset>") << "\n";
  }
  try {
    shardtrain::ClusterInfo info = shardtrain::DetectClusterEnvironment();
    os << "detected=" << info.source << " " << info.rank << " " << info.world_size << " " << info.local_rank << " "
       << info.local_world_size << " " << info.master_addr << ":" << info.master_port << "\n";
  } catch (const std::exception& e) {
    os << "detected=error " << e.what() << "\n";
  }
  os << "pid=" << getpid() << "\n";
  std::string path = dir + "/rank_" + std::to_string(rank) + ".txt";
  {
    std::ofstream out(path + ".tmp");
    out << os.str();
  }
  std::rename((path + ".tmp").c_str(), path.c_str());  // readers see a whole file
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_dir = Env("HELPER_OUT_DIR", "/tmp");
  std::snprintf(g_out_dir, sizeof(g_out_dir), "%s", out_dir.c_str());
  // Installed before LaunchLocalRanks, so the launcher chains to it in rank 0.
  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);

  int self_launch = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--self_launch=", 14) == 0) self_launch = std::atoi(argv[i] + 14);
  }
  int rank = 0;
  if (self_launch > 0) {
    shardtrain::LaunchOptions options;
    options.num_ranks = self_launch;
    options.kill_grace = std::chrono::milliseconds(2000);
    rank = shardtrain::LaunchLocalRanks(options);
  } else {
    rank = std::atoi(Env("RANK", "0").c_str());
  }
  g_rank.store(rank);
  std::printf("RANK=%s\n", Env("RANK", "<unset>").c_str());
  std::fflush(stdout);
  WriteReport(rank);
  if (Env("HELPER_SYNC") == "1") {
    int world = std::atoi(Env("WORLD_SIZE", "1").c_str());
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (int k = 0; k < world; ++k) {
      std::string path = out_dir + "/rank_" + std::to_string(k) + ".txt";
      while (access(path.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  }

  std::vector<int> codes = IntList(Env("HELPER_EXIT_CODES"));
  std::vector<int> hang = IntList(Env("HELPER_HANG_RANKS"));
  int code = rank < static_cast<int>(codes.size()) ? codes[rank] : 0;
  if (Env("HELPER_KILL_SELF_RANK", "-1") == std::to_string(rank)) raise(SIGKILL);
  for (int h : hang) {
    if (h == rank) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      code = 99;  // not killed: the test fails on this
    }
  }
  if (self_launch > 0 && rank == 0) return shardtrain::JoinLocalRanks(code);
  return code;
}
