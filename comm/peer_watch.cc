#include "comm/peer_watch.h"

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "base/errors.h"
#include "base/logging.h"
#include "base/time_text.h"

namespace shardtrain::comm {
namespace {

using SteadyClock = std::chrono::steady_clock;

// The host name part of a local_host::Id() ("name/boot:...").
std::string HostName(const std::string& id) { return id.substr(0, id.find('/')); }

// A heartbeat older than this many periods means the publishing thread stopped.
constexpr int kStalePeriods = 3;
// Slices of a wait that may fail on a stall (the wait returns at once on completion).
constexpr std::chrono::milliseconds kSlice{100};
constexpr std::chrono::milliseconds kStopWait{3000};

}  // namespace

struct PeerWatch::State {
  struct Wait {
    int64_t seq;
    std::string op;
    int64_t start_wall;
    SteadyClock::time_point start;
  };
  struct Peer {
    int64_t issued = -1;          // last seen
    int64_t issued_changed = 0;   // wall ms when `issued` last changed (0: unknown)
    bool stale = false;           // its heartbeat had stopped at the last read
    bool warned = false;          // this stall was reported
  };

  PeerWatchOptions opts;
  Reader read;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool exited = false;
  std::map<int64_t, Wait> waits;  // by id
  int64_t next_id = 0;
  std::string failure;
  std::string last_warning;
  int64_t warnings = 0;
  std::function<void()> abort;
  std::vector<Peer> peers;

  void Run();
  // Judges the peers from `beats` read at `now` while the oldest wait is `w`
  // (and the lowest collective waited for is `seq`).
  void Judge(const std::vector<std::optional<PeerBeat>>& beats, int64_t now, const Wait& w, int64_t seq);
};

void PeerWatch::State::Run() {
  std::unique_lock<std::mutex> lock(mu);
  auto next_read = SteadyClock::time_point::min();
  while (!stop) {
    if (waits.empty()) {
      cv.wait(lock, [&] { return stop || !waits.empty(); });
      continue;
    }
    Wait oldest = waits.begin()->second;
    int64_t seq = oldest.seq;
    for (const auto& [id, w] : waits) {
      if (w.start < oldest.start) oldest = w;
      seq = std::min(seq, w.seq);
    }
    // Collectives that finish within a period cost no store traffic.
    const auto due = std::max(oldest.start + opts.period, next_read);
    if (SteadyClock::now() < due) {
      cv.wait_until(lock, due);
      continue;
    }
    lock.unlock();
    std::vector<std::optional<PeerBeat>> beats;
    bool ok = true;
    try {
      beats = read();
    } catch (const std::exception&) {
      ok = false;  // the store is gone: the collective's own failure says so
    }
    lock.lock();
    next_read = SteadyClock::now() + opts.period;
    if (ok && !stop && !waits.empty()) Judge(beats, WallClockMs(), oldest, seq);
  }
  exited = true;
  cv.notify_all();
}

void PeerWatch::State::Judge(const std::vector<std::optional<PeerBeat>>& beats, int64_t now, const Wait& w,
                             int64_t seq) {
  for (int r = 0; r < opts.size && r < static_cast<int>(beats.size()); ++r) {
    if (r == opts.rank || !beats[r] || beats[r]->closed) continue;
    const PeerBeat& h = *beats[r];
    Peer& p = peers[r];
    const bool stale = now - h.wall_ms > kStalePeriods * opts.period.count();
    if (h.issued != p.issued || (p.stale && !stale)) {  // progress, or resumed: a new stall starts from here
      p.issued = h.issued;
      p.issued_changed = now;
      p.warned = false;
    }
    p.stale = stale;
    int64_t since;  // no progress since (wall ms), counted only while this rank is blocked
    std::string why;
    if (stale) {
      since = std::max(h.wall_ms, w.start_wall);
      why = internal::StrCat("its heartbeat stopped ", FormatSeconds(now - h.wall_ms),
                             " ago (the process is stopped or hung, or its host is unreachable)");
    } else if (h.issued < seq) {
      since = std::max(p.issued_changed, w.start_wall);
      why = internal::StrCat("it is alive (heartbeat ", FormatSeconds(std::max<int64_t>(now - h.wall_ms, 0)),
                             " ago) but has not issued the collective this rank waits in");
    } else {
      p.warned = false;  // it reached this collective: not at fault
      continue;
    }
    const int64_t stalled = now - since;
    const std::string text = internal::StrCat(
        "rank ", r, " of group '", opts.group, "' (pid ", h.pid, ", host ", HostName(h.host),
        ") has made no progress for ", FormatSeconds(stalled), ": ", why,
        h.exact ? "; its latest collective is #" : "; its last heartbeat says collective #", h.issued,
        h.op.empty() || h.op == "-" ? "" : " (" + h.op + ")", "; this rank (", opts.rank, ") waits in collective #",
        w.seq, " (", w.op, ") since ", FormatSeconds(now - w.start_wall), " ago");
    if (opts.stall_warning.count() > 0 && stalled >= opts.stall_warning.count() && !p.warned) {
      p.warned = true;
      last_warning = internal::StrCat("stalled peer: ", text, " (warning after ", opts.options_name,
                                      "::stall_warning = ", FormatSeconds(opts.stall_warning.count()),
                                      "; the Trainer's: --stall_warning_s)");
      ++warnings;
      ST_LOG(WARNING) << last_warning;
    }
    if (opts.stall_timeout.count() > 0 && stalled >= opts.stall_timeout.count() && failure.empty()) {
      failure = internal::StrCat("stalled peer: ", text, "; giving up after ", opts.options_name,
                                 "::stall_timeout = ", FormatSeconds(opts.stall_timeout.count()),
                                 " (the Trainer's: --stall_timeout_s; the group is unusable from now on)");
      ST_LOG(ERROR) << failure;
      cv.notify_all();
      if (abort) abort();
    }
  }
}

PeerWatch::PeerWatch(PeerWatchOptions options, Reader read) : state_(std::make_shared<State>()) {
  state_->opts = std::move(options);
  state_->read = std::move(read);
  state_->peers.resize(std::max(state_->opts.size, 0));
  std::thread([s = state_] { s->Run(); }).detach();
}

PeerWatch::~PeerWatch() { Stop(); }

void PeerWatch::Stop() {
  std::unique_lock<std::mutex> lock(state_->mu);
  if (state_->stop) return;  // stopped before (a thread stuck in the store is left behind once)
  state_->stop = true;
  state_->abort = nullptr;
  state_->cv.notify_all();
  // A thread stuck in an unresponsive store keeps only the shared state alive.
  state_->cv.wait_for(lock, kStopWait, [&] { return state_->exited; });
}

void PeerWatch::OnStallFailure(std::function<void()> abort) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->stop) state_->abort = std::move(abort);
}

std::string PeerWatch::Failure() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->failure;
}

std::string PeerWatch::LastWarning() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->last_warning;
}

int64_t PeerWatch::Warnings() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->warnings;
}

PeerWatch::Waiting::Waiting(PeerWatch* watch, int64_t seq, const char* op) : watch_(watch) {
  if (!watch_) return;
  State& s = *watch_->state_;
  std::lock_guard<std::mutex> lock(s.mu);
  id_ = ++s.next_id;
  s.waits[id_] = State::Wait{seq, op, WallClockMs(), SteadyClock::now()};
  s.cv.notify_all();
}

PeerWatch::Waiting::~Waiting() {
  if (!watch_) return;
  std::lock_guard<std::mutex> lock(watch_->state_->mu);
  watch_->state_->waits.erase(id_);
}

void PeerWatch::Wait(PeerWatch* watch, int64_t seq, const char* op, std::chrono::milliseconds timeout,
                     const std::function<void(std::chrono::milliseconds)>& wait, const std::function<bool()>& done) {
  Waiting waiting(watch, seq, op);
  if (!watch || watch->state_->opts.stall_timeout.count() == 0) {
    wait(timeout);
    return;
  }
  const auto deadline = SteadyClock::now() + timeout;
  for (;;) {
    if (std::string f = watch->Failure(); !f.empty()) throw CommTimeoutError(f);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
    const auto slice = std::max(std::chrono::milliseconds(1), std::min(left, kSlice));
    bool again = false;
    try {
      wait(slice);
      return;
    } catch (...) {
      if (done()) {
        again = true;  // finished just after the slice: wait() now returns or throws its own error
      } else if (slice >= left) {
        throw;  // the collective's own timeout
      }
    }
    if (again) {
      wait(slice);
      return;
    }
  }
}

void CheckStallOptions(std::chrono::milliseconds stall_warning, std::chrono::milliseconds stall_timeout,
                       const char* options_name) {
  ST_CHECK_ARG(stall_warning.count() >= 0, options_name, ".stall_warning must be >= 0 ms (0: no warning), got ",
               stall_warning.count(), " ms");
  ST_CHECK_ARG(stall_timeout.count() >= 0, options_name,
               ".stall_timeout must be >= 0 ms (0: never fail on a stall), got ", stall_timeout.count(), " ms");
}

}  // namespace shardtrain::comm
