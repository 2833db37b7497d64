// The local launcher with real processes: launcher_test_helper plays the
// ranks, both re-executed by a trainer-like rank 0 (LaunchLocalRanks) and
// started by the shardtrain_launch binary; LocalLauncher is also driven
// in-process from this test.
#include "launch/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "launch/cluster_environment.h"

extern char** environ;

namespace shardtrain {
namespace {

using Clock = std::chrono::steady_clock;
using EnvMap = std::map<std::string, std::string>;

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  std::string base = srcdir ? srcdir : ".";
  return base + "/" + (workspace ? workspace : "shardtrain") + "/" + path;
}

std::string HelperPath() { return Runfile("tests/launch/launcher_test_helper"); }
std::string LaunchBinaryPath() { return Runfile("launch/shardtrain_launch"); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// Key=value lines of a rank report.
EnvMap ReadReport(const std::string& path) {
  EnvMap m;
  std::stringstream ss(ReadFile(path));
  std::string line;
  while (std::getline(ss, line)) {
    size_t eq = line.find('=');
    if (eq != std::string::npos) m[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return m;
}

bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

// A fresh output directory per test.
std::string MakeOutDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string base = tmp ? tmp : "/tmp";
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string dir = base + "/" + info->test_suite_name() + "." + info->name();
  std::string cmd = "rm -rf '" + dir + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_EQ(mkdir(dir.c_str(), 0755), 0);
  return dir;
}

// Variables a launcher sets; scrubbed so a child of this test starts clean
// (the in-process tests set them in this process).
const std::set<std::string> kLauncherVars = {"RANK",        "LOCAL_RANK",       "WORLD_SIZE",
                                             "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                             "MASTER_ADDR", "MASTER_PORT",      "SHARDTRAIN_LAUNCHED"};

struct Proc {
  pid_t pid = -1;
  std::string stdout_path, stderr_path;
};

Proc Spawn(const std::vector<std::string>& args, const EnvMap& env, const std::string& out_dir) {
  Proc p;
  p.stdout_path = out_dir + "/stdout.txt";
  p.stderr_path = out_dir + "/stderr.txt";
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    if (kLauncherVars.count(name) == 0 && env.count(name) == 0) env_storage.push_back(entry);
  }
  for (const auto& [k, v] : env) env_storage.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args_copy = args;
  for (auto& a : args_copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  p.pid = fork();
  if (p.pid == 0) {
    int out = open(p.stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = open(p.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, STDOUT_FILENO);
    dup2(err, STDERR_FILENO);
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  return p;
}

struct Result {
  int status = -1;
  bool timed_out = false;
  double seconds = 0;
  std::string out, err;
  bool exited_with(int code) const { return WIFEXITED(status) && WEXITSTATUS(status) == code; }
};

Result Wait(const Proc& p, std::chrono::milliseconds timeout, Clock::time_point start = Clock::now()) {
  Result r;
  auto deadline = Clock::now() + timeout;
  while (true) {
    pid_t got = waitpid(p.pid, &r.status, WNOHANG);
    if (got == p.pid) break;
    if (Clock::now() > deadline) {
      r.timed_out = true;
      kill(p.pid, SIGKILL);
      waitpid(p.pid, &r.status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.out = ReadFile(p.stdout_path);
  r.err = ReadFile(p.stderr_path);
  return r;
}

Result RunProc(const std::vector<std::string>& args, const EnvMap& env, const std::string& out_dir,
           std::chrono::milliseconds timeout = std::chrono::milliseconds(8000)) {
  auto start = Clock::now();
  return Wait(Spawn(args, env, out_dir), timeout, start);
}

// Each rank's report: the launcher's variables, and what DetectClusterEnvironment saw.
void ExpectRankReports(const std::string& dir, int n, bool rank0_is_launched) {
  std::string port;
  for (int r = 0; r < n; ++r) {
    std::string path = dir + "/rank_" + std::to_string(r) + ".txt";
    ASSERT_TRUE(Exists(path)) << path;
    EnvMap m = ReadReport(path);
    EXPECT_EQ(m["RANK"], std::to_string(r));
    EXPECT_EQ(m["LOCAL_RANK"], std::to_string(r));
    EXPECT_EQ(m["WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(m["LOCAL_WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(m["GROUP_RANK"], "0");
    EXPECT_EQ(m["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(m["SHARDTRAIN_LAUNCHED"], (r > 0 || rank0_is_launched) ? "1" : "<unset>");
    int p = std::atoi(m["MASTER_PORT"].c_str());
    EXPECT_GT(p, 0);
    EXPECT_LE(p, 65535);
    if (r == 0) port = m["MASTER_PORT"];
    EXPECT_EQ(m["MASTER_PORT"], port) << "rank " << r;
    EXPECT_EQ(m["detected"], "torchrun " + std::to_string(r) + " " + std::to_string(n) + " " + std::to_string(r) +
                                 " " + std::to_string(n) + " 127.0.0.1:" + port);
  }
}

bool Contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

// ---- LaunchLocalRanks: a trainer re-executes itself --------------------------

TEST(LaunchLocalRanksTest, AllRanksRunWithTheirEnvironment) {
  std::string dir = MakeOutDir();
  Result r = RunProc({HelperPath(), "--self_launch=3"}, {{"HELPER_OUT_DIR", dir}}, dir);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_TRUE(r.exited_with(0)) << "status " << r.status << "\n" << r.err;
  ExpectRankReports(dir, 3, /*rank0_is_launched=*/true);  // rank 0 sets the variables in itself
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(Contains(r.out, "RANK=" + std::to_string(k))) << r.out;
}

TEST(LaunchLocalRanksTest, FailingRankStopsTheOthers) {
  // Rank 1 exits 3 while ranks 0 and 2 hang: the monitor kills rank 2 and ends rank 0.
  std::string dir = MakeOutDir();
  Result r = RunProc({HelperPath(), "--self_launch=3"},
                 {{"HELPER_OUT_DIR", dir}, {"HELPER_SYNC", "1"}, {"HELPER_EXIT_CODES", "0,3,0"}, {"HELPER_HANG_RANKS", "0,2"}}, dir);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_TRUE(r.exited_with(1)) << "status " << r.status << "\n" << r.err;
  EXPECT_TRUE(Contains(r.err, "ShardTrain launcher: rank 1 (pid ")) << r.err;
  EXPECT_TRUE(Contains(r.err, "exited with code 3; terminating the other ranks")) << r.err;
  EXPECT_TRUE(Exists(dir + "/signal_rank_2")) << "rank 2 was not sent SIGTERM";
  EXPECT_LT(r.seconds, 5.0);
}

TEST(LaunchLocalRanksTest, Rank0FailureTerminatesTheOthers) {
  std::string dir = MakeOutDir();
  Result r = RunProc({HelperPath(), "--self_launch=2"},
                 {{"HELPER_OUT_DIR", dir}, {"HELPER_SYNC", "1"}, {"HELPER_EXIT_CODES", "4"}, {"HELPER_HANG_RANKS", "1"}}, dir);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_TRUE(r.exited_with(4)) << "status " << r.status << "\n" << r.err;
  EXPECT_TRUE(Contains(r.err, "rank 0 (pid ")) << r.err;
  EXPECT_TRUE(Exists(dir + "/signal_rank_1"));
}

TEST(LaunchLocalRanksTest, SignalToRank0ReachesTheOthers) {
  std::string dir = MakeOutDir();
  Proc p = Spawn({HelperPath(), "--self_launch=3"}, {{"HELPER_OUT_DIR", dir}, {"HELPER_HANG_RANKS", "0,1,2"}}, dir);
  ASSERT_TRUE(WaitFor([&] { return Exists(dir + "/rank_0.txt") && Exists(dir + "/rank_1.txt") &&
                                   Exists(dir + "/rank_2.txt"); },
                      std::chrono::milliseconds(5000)));
  kill(p.pid, SIGTERM);
  Result r = Wait(p, std::chrono::milliseconds(5000));
  ASSERT_FALSE(r.timed_out);
  // Rank 0's own handler ran (chained after forwarding) and it died by SIGTERM.
  EXPECT_TRUE(WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGTERM) << "status " << r.status;
  for (int k = 0; k < 3; ++k) {
    EXPECT_TRUE(WaitFor([&] { return Exists(dir + "/signal_rank_" + std::to_string(k)); },
                        std::chrono::milliseconds(3000)))
        << "rank " << k;
  }
}

// ---- shardtrain_launch: all ranks are children --------------------------------

TEST(ShardtrainLaunchTest, AllRanksRunWithTheirEnvironment) {
  std::string dir = MakeOutDir();
  Result r = RunProc({LaunchBinaryPath(), "--nproc", "3", "--", HelperPath()}, {{"HELPER_OUT_DIR", dir}}, dir);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_TRUE(r.exited_with(0)) << "status " << r.status << "\n" << r.err;
  ExpectRankReports(dir, 3, /*rank0_is_launched=*/true);
}

TEST(ShardtrainLaunchTest, ExplicitPortAndFailingRank) {
  std::string dir = MakeOutDir();
  int port = PickFreePort();
  Result r = RunProc({LaunchBinaryPath(), "--nproc=4", "--master_port", std::to_string(port), "--kill_grace_ms=2000",
                  HelperPath(), "--some-arg"},
                 {{"HELPER_OUT_DIR", dir}, {"HELPER_SYNC", "1"}, {"HELPER_EXIT_CODES", "0,0,3,0"}, {"HELPER_HANG_RANKS", "0,1,3"}}, dir);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_TRUE(r.exited_with(1)) << "status " << r.status << "\n" << r.err;
  EXPECT_TRUE(Contains(r.err, "ShardTrain launcher: rank 2 (pid ")) << r.err;
  EXPECT_TRUE(Contains(r.err, "exited with code 3; terminating the other ranks")) << r.err;
  for (int k : {0, 1, 3}) EXPECT_TRUE(Exists(dir + "/signal_rank_" + std::to_string(k))) << "rank " << k;
  EXPECT_EQ(ReadReport(dir + "/rank_0.txt")["MASTER_PORT"], std::to_string(port));
  EXPECT_LT(r.seconds, 5.0);
}

TEST(ShardtrainLaunchTest, RankKilledBySignal) {
  std::string dir = MakeOutDir();
  Result r = RunProc({LaunchBinaryPath(), "--nproc", "2", "--", HelperPath()},
                 {{"HELPER_OUT_DIR", dir}, {"HELPER_SYNC", "1"}, {"HELPER_KILL_SELF_RANK", "1"}, {"HELPER_HANG_RANKS", "0"}}, dir);
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_TRUE(r.exited_with(1)) << "status " << r.status << "\n" << r.err;
  EXPECT_TRUE(Contains(r.err, "rank 1 (pid ")) << r.err;
  EXPECT_TRUE(Contains(r.err, "was killed by signal 9 (SIGKILL)")) << r.err;
  EXPECT_TRUE(Exists(dir + "/signal_rank_0"));
}

TEST(ShardtrainLaunchTest, ForwardsSigterm) {
  std::string dir = MakeOutDir();
  Proc p = Spawn({LaunchBinaryPath(), "--nproc", "3", "--", HelperPath()},
                 {{"HELPER_OUT_DIR", dir}, {"HELPER_HANG_RANKS", "0,1,2"}}, dir);
  ASSERT_TRUE(WaitFor([&] { return Exists(dir + "/rank_0.txt") && Exists(dir + "/rank_1.txt") &&
                                   Exists(dir + "/rank_2.txt"); },
                      std::chrono::milliseconds(5000)));
  kill(p.pid, SIGTERM);
  Result r = Wait(p, std::chrono::milliseconds(5000));
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_TRUE(r.exited_with(128 + SIGTERM)) << "status " << r.status << "\n" << r.err;
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(ReadFile(dir + "/signal_rank_" + std::to_string(k)), "15\n") << "rank " << k;
  }
  EXPECT_TRUE(Contains(r.err, "received SIGTERM")) << r.err;
}

TEST(ShardtrainLaunchTest, BadCommandLine) {
  std::string dir = MakeOutDir();
  Result r = RunProc({LaunchBinaryPath(), "--nproc", "x", "--", HelperPath()}, {}, dir);
  EXPECT_TRUE(r.exited_with(2)) << r.err;
  EXPECT_TRUE(Contains(r.err, "--nproc='x'")) << r.err;
  r = RunProc({LaunchBinaryPath(), "--nproc", "2"}, {}, dir);
  EXPECT_TRUE(r.exited_with(2)) << r.err;
  r = RunProc({LaunchBinaryPath(), "--nproc", "2", "--", "/nonexistent/prog"}, {}, dir);
  EXPECT_TRUE(r.exited_with(2)) << r.err;
  EXPECT_TRUE(Contains(r.err, "/nonexistent/prog")) << r.err;
}

// ---- LocalLauncher in this process (rank 0 = this test) -----------------------

// Options.env is also set in this (rank 0) process: clear it between tests.
class LocalLauncherTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const char* name : {"HELPER_OUT_DIR", "HELPER_EXIT_CODES", "HELPER_HANG_RANKS", "HELPER_SYNC",
                             "HELPER_EXTRA"}) {
      unsetenv(name);
    }
  }
};

TEST_F(LocalLauncherTest, JoinReportsTheFailedRank) {
  std::string dir = MakeOutDir();
  LaunchOptions o;
  o.num_ranks = 3;
  o.argv = {HelperPath()};
  o.env = {{"HELPER_OUT_DIR", dir}, {"HELPER_SYNC", "1"}, {"HELPER_EXIT_CODES", "0,0,3"}, {"HELPER_EXTRA", "x y"}};
  std::ofstream(dir + "/rank_0.txt") << "RANK=0\n";  // rank 0 (this test) is ready
  LocalLauncher launcher(o);
  launcher.Start();
  EXPECT_EQ(launcher.child_pids().size(), 2u);
  // This process is rank 0 and sees torchrun-style variables.
  ClusterInfo self = DetectClusterEnvironment();
  EXPECT_EQ(self.source, "torchrun");
  EXPECT_EQ(self.rank, 0);
  EXPECT_EQ(self.world_size, 3);
  EXPECT_EQ(self.master_port, launcher.master_port());
  EXPECT_NE(launcher.Join(0), 0);
  EXPECT_EQ(launcher.failed_rank(), 2);
  EXPECT_TRUE(Contains(launcher.failure_message(), "rank 2 (pid ")) << launcher.failure_message();
  EXPECT_TRUE(Contains(launcher.failure_message(), "exited with code 3")) << launcher.failure_message();
  EXPECT_EQ(ReadReport(dir + "/rank_1.txt")["HELPER_EXTRA"], "x y");
}

TEST_F(LocalLauncherTest, JoinSucceeds) {
  std::string dir = MakeOutDir();
  LaunchOptions o;
  o.num_ranks = 3;
  o.argv = {HelperPath()};
  o.env = {{"HELPER_OUT_DIR", dir}};
  LocalLauncher launcher(o);
  launcher.Start();
  EXPECT_EQ(launcher.Join(0), 0);
  EXPECT_EQ(launcher.failed_rank(), -1);
  EXPECT_EQ(ReadReport(dir + "/rank_2.txt")["RANK"], "2");
  EXPECT_EQ(ReadReport(dir + "/rank_1.txt")["MASTER_PORT"], std::to_string(launcher.master_port()));
}

TEST_F(LocalLauncherTest, Rank0FailureKillsHangingChildren) {
  std::string dir = MakeOutDir();
  LaunchOptions o;
  o.num_ranks = 3;
  o.argv = {HelperPath()};
  o.env = {{"HELPER_OUT_DIR", dir}, {"HELPER_HANG_RANKS", "1,2"}};
  o.kill_grace = std::chrono::milliseconds(2000);
  LocalLauncher launcher(o);
  launcher.Start();
  ASSERT_TRUE(WaitFor([&] { return Exists(dir + "/rank_1.txt") && Exists(dir + "/rank_2.txt"); },
                      std::chrono::milliseconds(5000)));
  auto start = Clock::now();
  EXPECT_EQ(launcher.Join(7), 7);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 3.0);
  EXPECT_TRUE(Exists(dir + "/signal_rank_1"));
  EXPECT_TRUE(Exists(dir + "/signal_rank_2"));
}

TEST_F(LocalLauncherTest, BadOptions) {
  LaunchOptions o;
  o.num_ranks = 0;
  EXPECT_THROW(LocalLauncher(o).Start(), InvalidArgumentError);
  o.num_ranks = 2;
  o.master_port = 70000;
  EXPECT_THROW(LocalLauncher(o).Start(), InvalidArgumentError);
  o.master_port = 0;
  o.argv = {"no_such_program_shardtrain"};
  EXPECT_THROW(LocalLauncher(o).Start(), InvalidArgumentError);
  o.argv = {};
  o.current_process_is_rank0 = false;
  EXPECT_THROW(LocalLauncher(o).Start(), InvalidArgumentError);
}

TEST_F(LocalLauncherTest, PickFreePort) {
  int a = PickFreePort();
  EXPECT_GT(a, 0);
  EXPECT_LE(a, 65535);
}

}  // namespace
}  // namespace shardtrain
