// Local multi-process launch: run N ranks on this machine, like Lightning's
// subprocess script launcher. The current process stays rank 0 and re-executes
// its own binary for ranks 1..N-1 with torchrun-style variables (RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT, SHARDTRAIN_LAUNCHED=1), so DetectClusterEnvironment() in every
// rank reads them as a "torchrun" environment. Fail fast: when any rank dies,
// the others are terminated and the launcher exits non-zero naming that rank.
// POSIX/Linux only; no torch header.
#ifndef SHARDTRAIN_LAUNCH_LAUNCHER_H_
#define SHARDTRAIN_LAUNCH_LAUNCHER_H_

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain {

// Set in the environment of every rank started by the launcher.
inline constexpr const char* kLaunchedEnvVar = "SHARDTRAIN_LAUNCHED";
// The rendezvous store's shared secret (comm/signed_store.h reads the same
// names): when neither is set, Start() generates a random secret and gives it
// to every rank it starts (and to this process when it is rank 0) in
// SHARDTRAIN_SECRET.
inline constexpr const char* kSecretEnvVar = "SHARDTRAIN_SECRET";
inline constexpr const char* kSecretFileEnvVar = "SHARDTRAIN_SECRET_FILE";

// What to launch and how.
struct LaunchOptions {
  int num_ranks = 1;
  // Program and arguments of ranks 1..N-1 (all ranks when
  // current_process_is_rank0 is false). Empty: /proc/self/exe with this
  // process's own argv. A program without '/' is looked up in PATH.
  std::vector<std::string> argv;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free port (bind port 0 on master_addr)
  // Extra variables for every rank (also set in this process when it is rank 0).
  std::vector<std::pair<std::string, std::string>> env;
  // true: this process is rank 0 and spawns 1..N-1 (a trainer); false: all N
  // ranks are children (the shardtrain_launch binary).
  bool current_process_is_rank0 = true;
  // Between SIGTERM and SIGKILL when terminating ranks.
  std::chrono::milliseconds kill_grace{5000};
};

// Spawns and supervises local ranks. One LocalLauncher at a time may be
// started in a process (it owns the SIGINT/SIGTERM handlers).
//
// Thread-safety: Start, MonitorInBackground and Join are called from one
// thread; call Start from the main thread, early, before other threads read
// the environment (it calls setenv) — children get SIGTERM when the thread that
// started them exits (PR_SET_PDEATHSIG).
class LocalLauncher {
 public:
  explicit LocalLauncher(LaunchOptions options);
  // Terminates (SIGTERM, then SIGKILL) children still running and reaps them.
  ~LocalLauncher();
  LocalLauncher(const LocalLauncher&) = delete;
  LocalLauncher& operator=(const LocalLauncher&) = delete;

  // Validates the options, picks the port, sets the rank-0 variables in this
  // process (when it is rank 0), spawns the children and installs SIGINT/SIGTERM
  // handlers that forward the signal to them. When this process is rank 0 the
  // signal then takes its previous course here (previous handler, or default
  // action); otherwise (shardtrain_launch) a second signal sends SIGKILL.
  // Throws InvalidArgumentError for bad options, Error if fork fails.
  void Start();

  // Starts a thread that reaps the children. When one exits non-zero or by a
  // signal it prints "ShardTrain launcher: rank K (pid P) exited with code C;
  // terminating the other ranks" (or "was killed by signal S"), terminates the
  // other children and ends this process with _exit(1).
  void MonitorInBackground();

  // Waits for all children. rank0_exit_code != 0 means rank 0 (this process)
  // failed: the children are terminated and that code is returned. Otherwise
  // returns 0 if every child exited 0, else non-zero after printing which rank
  // failed (the other children are terminated as soon as one fails). After a
  // forwarded SIGINT/SIGTERM (shardtrain_launch) returns 128 + signal number.
  int Join(int rank0_exit_code = 0);

  int master_port() const { return master_port_; }
  // Pids of the spawned ranks, in rank order (rank 0 first when it is a child).
  std::vector<pid_t> child_pids() const;
  // Rank and message of the first failure seen by Join, -1 / "" if none.
  int failed_rank() const;
  std::string failure_message() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  LaunchOptions options_;
  int master_port_ = 0;
};

// For a trainer's main(): if this process was started by the launcher
// (SHARDTRAIN_LAUNCHED=1), returns its RANK and does nothing else. Otherwise,
// with num_ranks > 1, starts a process-wide LocalLauncher (this process is rank
// 0), monitors it in the background and returns 0; with num_ranks == 1 only
// sets the rank-0 variables. Call it only when no external launcher (torchrun,
// SLURM, MPI) started this process.
int LaunchLocalRanks(const LaunchOptions& options);

// Rank 0's last call before returning from main(): waits for the ranks
// started by LaunchLocalRanks (see LocalLauncher::Join) and returns the exit
// code to use. Returns rank0_exit_code in a launched child or without launcher.
int JoinLocalRanks(int rank0_exit_code);

// Picks a free TCP port by binding port 0 on `addr` (IPv4 literal or
// "localhost"; anything else binds all interfaces).
int PickFreePort(const std::string& addr = "127.0.0.1");

}  // namespace shardtrain

#endif  // SHARDTRAIN_LAUNCH_LAUNCHER_H_
