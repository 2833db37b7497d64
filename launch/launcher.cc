#include "launch/launcher.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "base/errors.h"
#include "launch/internal/process_util.h"

namespace shardtrain {
namespace {

using launch_internal::DescribeFailure;
using launch_internal::ReadSelfCmdline;
using launch_internal::ChildEnvironment;
using launch_internal::NewSecret;
using launch_internal::RankEnvironment;
using launch_internal::ResolveProgram;
using launch_internal::SelfExePath;
using launch_internal::SignalName;

// ---- Process-wide signal forwarding (async-signal-safe state only) ----------

constexpr int kMaxChildren = 4096;
std::atomic<pid_t> g_child_pids[kMaxChildren];
std::atomic<int> g_num_children{0};
std::atomic<int> g_signal_count{0};
std::atomic<int> g_last_signal{0};
std::atomic<bool> g_chain_to_previous{false};
std::atomic<bool> g_launcher_active{false};
struct sigaction g_previous_int;
struct sigaction g_previous_term;
struct sigaction g_previous_usr1;  // SIGUSR1: SLURM's --signal (the trainer's preemption request)

const struct sigaction& PreviousAction(int sig) {
  return sig == SIGINT ? g_previous_int : sig == SIGUSR1 ? g_previous_usr1 : g_previous_term;
}

// A rank that exits with 128 + SIGINT/SIGTERM/SIGUSR1 stopped on request
// (trainer/stop_signals.h: it saved a checkpoint first): not a failure.
bool IsStopCode(int code) { return code == 128 + SIGINT || code == 128 + SIGTERM || code == 128 + SIGUSR1; }
bool StoppedOnRequest(int status) { return WIFEXITED(status) && IsStopCode(WEXITSTATUS(status)); }

void ForwardSignal(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  const int count = g_signal_count.fetch_add(1) + 1;
  g_last_signal.store(sig);
  const bool chain = g_chain_to_previous.load();
  // A repeated signal to the standalone launcher means "now": SIGKILL.
  const int forwarded = (!chain && count > 1) ? SIGKILL : sig;
  const int n = g_num_children.load();
  for (int i = 0; i < n; ++i) {
    pid_t pid = g_child_pids[i].load();
    if (pid > 0) kill(pid, forwarded);
  }
  if (chain) {
    // This process is rank 0: let the signal take the course it had before.
    const struct sigaction& previous = PreviousAction(sig);
    if (previous.sa_flags & SA_SIGINFO) {
      if (previous.sa_sigaction != nullptr) previous.sa_sigaction(sig, info, context);
    } else if (previous.sa_handler == SIG_DFL) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      sigaction(sig, &dfl, nullptr);
      raise(sig);  // delivered (default action) when this handler returns
    } else if (previous.sa_handler != SIG_IGN && previous.sa_handler != nullptr) {
      previous.sa_handler(sig);
    }
  }
  errno = saved_errno;
}

void InstallSignalHandlers(bool chain) {
  g_chain_to_previous.store(chain);
  g_signal_count.store(0);
  g_last_signal.store(0);
  struct sigaction sa {};
  sa.sa_sigaction = &ForwardSignal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &g_previous_int);
  sigaction(SIGTERM, &sa, &g_previous_term);
  sigaction(SIGUSR1, &sa, &g_previous_usr1);
}

void RestoreSignalHandlers() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaction(SIGUSR1, &g_previous_usr1, nullptr);
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int slot = 0;
  bool running = false;
  int status = 0;
};

}  // namespace

// ---- LocalLauncher -------------------------------------------------------------

struct LocalLauncher::State {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Child> children;
  bool started = false;
  bool handlers_installed = false;
  bool done = false;  // every child reaped
  int result = 0;     // Join's result once done
  int failed_rank = -1;
  int stop_code = 0;  // a rank's exit status after a requested stop (StoppedOnRequest)
  std::string failure_message;
  std::thread monitor;
  std::atomic<bool> stop_monitor{false};
  bool monitor_running = false;
  std::chrono::milliseconds grace{5000};

  bool AnyRunning() const {
    for (const auto& c : children)
      if (c.running) return true;
    return false;
  }

  void MarkReaped(Child& c, int status) {
    c.running = false;
    c.status = status;
    g_child_pids[c.slot].store(0);
  }

  // Reaps `c` if it has exited. The pid is removed from the signal table before
  // it is reaped, so a forwarded signal can never hit a recycled pid.
  bool TryReap(Child& c) {
    if (!c.running) return false;
    siginfo_t info{};
    int rc = waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT);
    if (rc == 0 && info.si_pid == c.pid) {
      g_child_pids[c.slot].store(0);
      int status = 0;
      while (waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
      }
      MarkReaped(c, status);
      return true;
    }
    if (rc < 0 && errno == ECHILD) {  // reaped elsewhere (SIGCHLD ignored?)
      MarkReaped(c, 0);
      return true;
    }
    return false;
  }

  // SIGTERM to every running child, SIGKILL to those still alive after `grace`.
  // SIGCONT after SIGTERM: a stopped child (SIGSTOP, a debugger's stop) acts
  // on its SIGTERM at once instead of sitting out the grace period.
  void TerminateAll() {
    for (auto& c : children) {
      if (!c.running) continue;
      kill(c.pid, SIGTERM);
      kill(c.pid, SIGCONT);
    }
    auto deadline = std::chrono::steady_clock::now() + grace;
    while (AnyRunning() && std::chrono::steady_clock::now() < deadline) {
      for (auto& c : children) TryReap(c);
      if (AnyRunning()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (auto& c : children) {
      if (!c.running) continue;
      g_child_pids[c.slot].store(0);
      kill(c.pid, SIGKILL);
      int status = 0;
      while (waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
      }
      MarkReaped(c, status);
    }
  }

  void RecordFailure(const Child& c, const std::string& what) {
    failed_rank = c.rank;
    failure_message = internal::StrCat("ShardTrain launcher: rank ", c.rank, " (pid ", c.pid, ") ", what,
                                       "; terminating the other ranks");
    std::fprintf(stderr, "%s\n", failure_message.c_str());
    std::fflush(stderr);
  }

  // One pass over the children (mu held). Returns true when a child failed; the
  // others are then terminated and reaped.
  bool PollOnce() {
    for (auto& c : children) {
      if (!TryReap(c)) continue;
      std::string what = DescribeFailure(c.status);
      if (StoppedOnRequest(c.status)) {
        stop_code = WEXITSTATUS(c.status);
        continue;
      }
      if (!what.empty() && failed_rank < 0) {
        RecordFailure(c, what);
        TerminateAll();
        return true;
      }
    }
    return false;
  }

  // Waits until every child is reaped or one fails (mu held between polls).
  // Returns the result Join reports.
  int RunToCompletion(std::unique_lock<std::mutex>& lock, bool exit_process_on_failure) {
    while (AnyRunning()) {
      if (stop_monitor.load() && exit_process_on_failure) return 0;
      if (PollOnce()) {
        if (exit_process_on_failure) {
          std::fflush(stdout);
          std::fflush(stderr);
          _exit(1);
        }
        break;
      }
      if (!AnyRunning()) break;
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      lock.lock();
    }
    return Finish();
  }

  int Finish() {
    done = true;
    int sig = g_last_signal.load();
    if (failed_rank >= 0) {
      result = 1;
    } else {
      result = stop_code;
    }
    if (sig != 0 && !g_chain_to_previous.load()) {
      std::fprintf(stderr, "ShardTrain launcher: received %s and forwarded it to the ranks\n",
                   SignalName(sig).c_str());
      result = 128 + sig;
    }
    cv.notify_all();
    return result;
  }
};

LocalLauncher::LocalLauncher(LaunchOptions options) : state_(std::make_unique<State>()), options_(std::move(options)) {}

LocalLauncher::~LocalLauncher() {
  if (state_->monitor.joinable()) {
    state_->stop_monitor.store(true);
    state_->monitor.join();
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->AnyRunning()) state_->TerminateAll();
  }
  if (state_->handlers_installed) {
    RestoreSignalHandlers();
    g_num_children.store(0);
    g_launcher_active.store(false);
  }
}

namespace {

// Checks the options of a launch that forks `num_children` ranks.
void CheckLaunchOptions(const LaunchOptions& o, int num_children) {
  ST_CHECK_ARG(o.num_ranks >= 1, "launcher: num_ranks=", o.num_ranks, " must be >= 1");
  ST_CHECK_ARG(o.master_port >= 0 && o.master_port <= 65535, "launcher: master_port=", o.master_port,
               " must be 0 (pick a free port) or a TCP port in [1, 65535]");
  ST_CHECK_ARG(!o.master_addr.empty(), "launcher: master_addr is empty");
  ST_CHECK_ARG(o.kill_grace.count() >= 0, "launcher: kill_grace must be >= 0");
  ST_CHECK_ARG(num_children <= kMaxChildren, "launcher: num_ranks=", o.num_ranks, " exceeds ", kMaxChildren);
  for (const auto& [name, value] : o.env) {
    ST_CHECK_ARG(!name.empty() && name.find('=') == std::string::npos, "launcher: bad environment variable name '",
                 name, "'");
  }
}

// Forks and executes `program` with `argv` (null-terminated) and `env` for
// `rank`. With SIGINT/SIGTERM/SIGUSR1 blocked around fork, so `record(pid)` (in the
// parent) stores the pid before a forwarding handler can run, and the child
// does not run that handler before exec. Returns the pid, or -1 with
// *fork_errno set.
pid_t ForkRank(const std::string& program, std::vector<char*>& argv, std::vector<std::string>& env, int rank,
               pid_t parent_pid, const std::function<void(pid_t)>& record, int* fork_errno) {
  // Everything the child needs is built before fork: after fork it only calls
  // async-signal-safe functions.
  std::vector<char*> child_env;
  for (auto& e : env) child_env.push_back(e.data());
  child_env.push_back(nullptr);
  const std::string exec_failed_msg =
      "ShardTrain launcher: cannot execute " + program + " for rank " + std::to_string(rank) + "\n";
  sigset_t block, old_mask;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &block, &old_mask);
  pid_t pid = fork();
  if (pid == 0) {
    // The dispositions exec would give: ignored stays ignored, else default.
    for (int sig : {SIGINT, SIGTERM, SIGUSR1}) {
      const struct sigaction& previous = PreviousAction(sig);
      struct sigaction sa {};
      sa.sa_handler = (!(previous.sa_flags & SA_SIGINFO) && previous.sa_handler == SIG_IGN) ? SIG_IGN : SIG_DFL;
      sigemptyset(&sa.sa_mask);
      sigaction(sig, &sa, nullptr);
    }
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // rank 0 / the launcher died: stop too
    if (getppid() != parent_pid) _exit(1);
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    execve(program.c_str(), argv.data(), child_env.data());
    ssize_t ignored = write(STDERR_FILENO, exec_failed_msg.data(), exec_failed_msg.size());
    (void)ignored;
    _exit(127);
  }
  *fork_errno = errno;
  if (pid > 0) record(pid);
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  return pid;
}

}  // namespace

void LocalLauncher::Start() {
  State& s = *state_;
  ST_CHECK_ARG(!s.started, "launcher: Start() was already called");
  const LaunchOptions& o = options_;
  const int first_child_rank = o.current_process_is_rank0 ? 1 : 0;
  const int num_children = o.num_ranks - first_child_rank;
  CheckLaunchOptions(o, num_children);

  std::string program;
  std::vector<std::string> argv = o.argv;
  if (argv.empty()) {
    ST_CHECK_ARG(o.current_process_is_rank0, "launcher: argv (the program to run) is required when the current "
                                             "process is not rank 0");
    argv = ReadSelfCmdline();
    ST_CHECK_ARG(!argv.empty(), "launcher: cannot read /proc/self/cmdline");
    program = SelfExePath();
  } else if (num_children > 0) {
    program = ResolveProgram(argv[0]);
  }

  // The rendezvous store's secret (comm/signed_store.h) for the ranks of this
  // launch, unless the user gave one; children inherit it, rank 0 sets it.
  if (!std::getenv(kSecretEnvVar) && !std::getenv(kSecretFileEnvVar)) {
    options_.env.emplace_back(kSecretEnvVar, NewSecret());
  }
  master_port_ = o.master_port != 0 ? o.master_port : PickFreePort(o.master_addr);
  s.grace = o.kill_grace;
  if (o.current_process_is_rank0) {
    for (const auto& [name, value] : RankEnvironment(o, 0, master_port_)) setenv(name.c_str(), value.c_str(), 1);
  }
  s.started = true;
  if (num_children == 0) return;

  bool expected = false;
  if (!g_launcher_active.compare_exchange_strong(expected, true)) {
    ST_THROW(Error, "launcher: another LocalLauncher is already running in this process");
  }
  for (int i = 0; i < kMaxChildren; ++i) g_child_pids[i].store(0);
  g_num_children.store(num_children);
  InstallSignalHandlers(/*chain=*/o.current_process_is_rank0);
  s.handlers_installed = true;

  std::vector<char*> child_argv;
  for (auto& a : argv) child_argv.push_back(a.data());
  child_argv.push_back(nullptr);
  const pid_t parent_pid = getpid();
  for (int i = 0; i < num_children; ++i) {
    const int rank = first_child_rank + i;
    std::vector<std::string> env = ChildEnvironment(RankEnvironment(o, rank, master_port_));
    int fork_errno = 0;
    const pid_t pid = ForkRank(program, child_argv, env, rank, parent_pid, [&](pid_t child) {
      Child c;
      c.rank = rank;
      c.pid = child;
      c.slot = i;
      c.running = true;
      g_child_pids[i].store(child);
      std::lock_guard<std::mutex> lock(s.mu);
      s.children.push_back(c);
    }, &fork_errno);
    if (pid < 0) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.TerminateAll();
      ST_THROW(Error, "launcher: fork() failed for rank ", rank, ": ", std::strerror(fork_errno));
    }
  }
}

void LocalLauncher::MonitorInBackground() {
  State& s = *state_;
  ST_CHECK_ARG(s.started, "launcher: MonitorInBackground() before Start()");
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.monitor_running || s.done || s.children.empty()) return;
  s.monitor_running = true;
  s.monitor = std::thread([&s] {
    std::unique_lock<std::mutex> lock(s.mu);
    if (!s.stop_monitor.load()) s.RunToCompletion(lock, /*exit_process_on_failure=*/true);
    s.monitor_running = false;
    s.cv.notify_all();
  });
}

int LocalLauncher::Join(int rank0_exit_code) {
  State& s = *state_;
  if (!s.started || s.children.empty()) return rank0_exit_code;
  if (rank0_exit_code != 0 && !IsStopCode(rank0_exit_code)) {
    if (s.monitor.joinable()) {
      s.stop_monitor.store(true);
      s.monitor.join();
    }
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.AnyRunning()) {
      std::fprintf(stderr, "ShardTrain launcher: rank 0 (pid %d) exited with code %d; terminating the other ranks\n",
                   static_cast<int>(getpid()), rank0_exit_code);
      std::fflush(stderr);
      s.TerminateAll();
    }
    if (s.failed_rank < 0) {
      s.failed_rank = 0;
      s.failure_message = internal::StrCat("ShardTrain launcher: rank 0 (pid ", getpid(), ") exited with code ",
                                           rank0_exit_code, "; terminating the other ranks");
    }
    s.done = true;
    s.result = rank0_exit_code;
    return rank0_exit_code;
  }
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.monitor_running) s.cv.wait(lock, [&s] { return s.done || !s.monitor_running; });
  if (!s.monitor_running && s.monitor.joinable()) {
    // The monitor thread has finished its work: join it, so that it does not
    // outlive Join (ThreadSanitizer reported the unjoined thread as a leak).
    lock.unlock();
    s.monitor.join();
    lock.lock();
  }
  if (s.done) return rank0_exit_code != 0 ? rank0_exit_code : s.result;
  const int result = s.RunToCompletion(lock, /*exit_process_on_failure=*/false);
  return rank0_exit_code != 0 ? rank0_exit_code : result;
}

std::vector<pid_t> LocalLauncher::child_pids() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<pid_t> pids;
  for (const auto& c : state_->children) pids.push_back(c.pid);
  return pids;
}

int LocalLauncher::failed_rank() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->failed_rank;
}

std::string LocalLauncher::failure_message() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->failure_message;
}

}  // namespace shardtrain
