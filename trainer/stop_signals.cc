#include "trainer/stop_signals.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

namespace shardtrain::trainer {
namespace {

constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1};
// A repeat of the signal within this time counts as the same request: Ctrl-C
// reaches every rank of the terminal's process group directly and once more
// through the launcher, which forwards what it gets.
constexpr int64_t kRepeatWindowNs = 500'000'000;

std::atomic<int> g_received{0};
std::atomic<int64_t> g_received_at_ns{0};
std::atomic<int> g_active{0};  // live StopSignalScopes
std::mutex g_mu;               // guards install/restore
struct sigaction g_previous[3];

int64_t NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void Say(const char* a, const char* b, const char* c) {
  for (const char* s : {a, b, c}) {
    ssize_t ignored = ::write(STDERR_FILENO, s, std::strlen(s));
    (void)ignored;
  }
}

const char* Name(int sig) { return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "SIGUSR1"; }

// The signal's default action, now.
void DefaultAction(int sig) {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);  // delivered when the handler returns
}

void OnStopSignal(int sig, siginfo_t*, void*) {
  const int saved_errno = errno;
  if (g_active.load() == 0) {
    DefaultAction(sig);  // no Fit is running: as if we had never been installed
  } else {
    int expected = 0;
    if (g_received.compare_exchange_strong(expected, sig)) {
      g_received_at_ns.store(NowNs());
      Say("ShardTrain: ", Name(sig),
          " received: finishing the current step on every rank, then saving a checkpoint (send it again to "
          "abort at once)\n");
    } else if (NowNs() - g_received_at_ns.load() > kRepeatWindowNs) {
      Say("ShardTrain: ", Name(sig), " received again: aborting now\n");
      DefaultAction(sig);
    }
  }
  errno = saved_errno;
}

bool IsOurs(int sig) {
  struct sigaction cur {};
  sigaction(sig, nullptr, &cur);
  return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == &OnStopSignal;
}

}  // namespace

StopSignalScope::StopSignalScope() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_active.load() > 0) {
    g_active.fetch_add(1);
    return;
  }
  g_received.store(0);
  for (int i = 0; i < 3; ++i) {
    if (IsOurs(kStopSignals[i])) continue;  // left installed (under a chaining handler) by an earlier Fit
    struct sigaction sa {};
    sa.sa_sigaction = &OnStopSignal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(kStopSignals[i], &sa, &g_previous[i]);
  }
  g_active.store(1);
}

StopSignalScope::~StopSignalScope() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_active.fetch_sub(1) != 1) return;
  for (int i = 0; i < 3; ++i) {
    // A handler installed after ours (the launcher's) chains to ours, which
    // now acts as the default: leave it.
    if (IsOurs(kStopSignals[i])) sigaction(kStopSignals[i], &g_previous[i], nullptr);
  }
}

int ReceivedStopSignal() { return g_received.load(); }

std::string StopSignalName(int sig) {
  if (sig == SIGTERM || sig == SIGINT || sig == SIGUSR1) return Name(sig);
  return "signal " + std::to_string(sig);
}

int StopExitCode(int sig) { return 128 + sig; }

}  // namespace shardtrain::trainer
