// GlooPeerMonitor: heartbeats and failure diagnosis (see internal/peer_monitor.h).
#include "comm/gloo/internal/peer_monitor.h"

#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "base/errors.h"
#include "base/time_text.h"
#include "comm/gloo/shared_memory_mesh.h"

namespace shardtrain::comm {
namespace gloo_internal {

std::string Heartbeat::Format() const {
  return internal::StrCat(wall_ms, " ", issued, " ", op, " ", pid, " ", host, " ", closed ? "closed" : "up");
}

std::optional<Heartbeat> Heartbeat::Parse(const std::string& text) {
  std::istringstream is(text);
  Heartbeat h;
  std::string state;
  if (!(is >> h.wall_ms >> h.issued >> h.op >> h.pid >> h.host >> state)) return std::nullopt;
  h.closed = state == "closed";
  return h;
}

std::string Heartbeat::Progress() const {
  return internal::StrCat(issued, issued == 1 ? " collective" : " collectives", " issued",
                          op == "-" ? "" : ", the latest " + op);
}

}  // namespace gloo_internal

using gloo_internal::Heartbeat;

GlooPeerMonitor::GlooPeerMonitor(gloo_internal::HeartbeatStore store, std::string group, int rank, int size,
                                 std::chrono::milliseconds period)
    : store_(std::move(store)),
      group_(std::move(group)),
      rank_(rank),
      size_(size),
      period_(period),
      pid_(getpid()),
      host_(local_host::Id()),
      known_(size) {}

GlooPeerMonitor::~GlooPeerMonitor() {
  if (thread_.joinable()) thread_.detach();  // only if Stop() was never called
}

void GlooPeerMonitor::Start() {
  thread_ = std::thread([self = shared_from_this()] { self->Run(); });
}

void GlooPeerMonitor::SetLocalProgress(LocalProgress fn) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  local_progress_ = std::move(fn);
}

void GlooPeerMonitor::ApplyLocalProgress(Snapshot* s) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  if (!local_progress_) return;
  for (int r = 0; r < size_ && r < static_cast<int>(s->peers.size()); ++r) {
    if (r == rank_ || !s->peers[r]) continue;
    if (const auto p = local_progress_(r); p && p->first >= s->peers[r]->issued) {
      s->peers[r]->issued = p->first;
      s->peers[r]->op = p->second ? p->second : "-";
      s->peers[r]->exact = true;
    }
  }
}

void GlooPeerMonitor::Stop() {
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    local_progress_ = nullptr;
  }
  bool exited;
  {
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
    exited = cv_.wait_for(lock, kStopWait, [&] { return exited_; });
  }
  if (!thread_.joinable()) return;
  if (exited) {
    thread_.join();
  } else {
    thread_.detach();
  }
}

std::string GlooPeerMonitor::Rank(int r) const { return internal::StrCat("rank ", r, " of group '", group_, "'"); }

std::string GlooPeerMonitor::Diagnose(int64_t seq, int64_t issued_ms, const char* op, bool timed_out) {
  std::unique_lock<std::mutex> lock(mu_);
  Snapshot snap;
  const bool fresh = FreshRead(lock, &snap);
  std::vector<std::string> findings;
  std::vector<int> reached, alive;
  Judge(snap, fresh, seq, issued_ms, op, timed_out, &findings, &reached, &alive);
  if (findings.empty() && !timed_out && fresh && snap.ok) LookAgain(lock, snap, &findings, &reached, &alive);
  std::string text;
  for (const auto& f : findings) text += (text.empty() ? "" : "; ") + f;
  auto summary = [&](const std::vector<int>& ranks, const char* one, const char* many) {
    if (ranks.empty()) return;
    std::string list;
    for (size_t i = 0; i < ranks.size() && i < 16; ++i) list += (i ? ", " : "") + std::to_string(ranks[i]);
    if (ranks.size() > 16) list += ", ...";
    const bool every = static_cast<int>(ranks.size()) == size_ - 1 && size_ > 2;
    text += internal::StrCat(text.empty() ? "" : "; ", every ? "every peer (" : ranks.size() == 1 ? "rank " : "ranks ",
                             list, every ? ")" : "", " of group '", group_, "' ", ranks.size() == 1 ? one : many);
  };
  summary(reached, "is alive and has issued this collective", "are alive and have issued this collective");
  summary(alive, "is alive", "are alive");
  return text;
}

void GlooPeerMonitor::LookAgain(std::unique_lock<std::mutex>& lock, const Snapshot& snap,
                                std::vector<std::string>* findings, std::vector<int>* reached,
                                std::vector<int>* alive) {
  // A connection failed, yet every peer looks alive: a peer that died a
  // moment ago still has a fresh heartbeat. Look again once it would have
  // published its next one.
  cv_.wait_for(lock, period_ * 3 / 2, [&] { return exited_; });
  Snapshot again;
  if (!FreshRead(lock, &again) || !again.ok) return;
  for (int r = 0; r < size_; ++r) {
    const auto& a = snap.peers[r];
    const auto& b = again.peers[r];
    if (r == rank_ || !a || !b) continue;
    if (!b->closed && b->wall_ms == a->wall_ms && a->host == host_ && a->pid != pid_ &&
        local_host::ProcessGone(a->pid)) {
      // Judge's pid check ran while the peer was still exiting (its sockets
      // close before it becomes a zombie); now it is gone.
      findings->push_back(internal::StrCat(Rank(r), " (pid ", a->pid, " on this host) has died (", a->Progress(), ")"));
    } else if (!b->closed && b->wall_ms == a->wall_ms) {
      findings->push_back(internal::StrCat(Rank(r), ": its heartbeat stopped (not renewed for ",
                                           FormatSeconds(again.wall_ms - a->wall_ms), ": dead or hung; ", a->Progress(),
                                           ")"));
    } else if (b->closed) {
      findings->push_back(internal::StrCat(Rank(r), " has closed its communicator (", b->Progress(), ")"));
    } else {
      continue;
    }
    reached->erase(std::remove(reached->begin(), reached->end(), r), reached->end());
    alive->erase(std::remove(alive->begin(), alive->end(), r), alive->end());
  }
}

void GlooPeerMonitor::Run() {
  auto next_publish = std::chrono::steady_clock::now();
  int identity_reads = 10;  // reads until every peer's pid and host are known
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const bool read_wanted = reads_requested_ > reads_done_;
    const auto now = std::chrono::steady_clock::now();
    if (!read_wanted && now < next_publish) {
      cv_.wait_until(lock, next_publish);
      continue;
    }
    const int64_t request = reads_requested_;
    lock.unlock();
    if (now >= next_publish) {
      Publish(false);
      next_publish = now + period_;
    }
    std::optional<Snapshot> snap;
    if (read_wanted || identity_reads > 0) snap = Read();
    lock.lock();
    if (!snap) continue;
    bool all_known = true;
    for (int r = 0; r < size_; ++r) {
      if (snap->peers[r]) known_[r] = snap->peers[r];
      all_known = all_known && (r == rank_ || known_[r]);
    }
    identity_reads = all_known ? 0 : identity_reads - 1;
    if (read_wanted) {
      latest_ = std::move(*snap);
      reads_done_ = request;
      cv_.notify_all();
    }
  }
  lock.unlock();
  Publish(true);
  lock.lock();
  exited_ = true;
  cv_.notify_all();
}

void GlooPeerMonitor::Publish(bool closed) {
  Heartbeat h;
  h.wall_ms = WallClockMs();
  h.issued = issued_.load(std::memory_order_acquire);
  if (const char* op = last_op_.load(std::memory_order_relaxed)) h.op = op;
  h.pid = pid_;
  h.host = host_;
  h.closed = closed;
  try {
    store_.set(Key(rank_), h.Format());
  } catch (const std::exception&) {
    // The store is gone or unreachable; a failing collective says so when it reads.
  }
}

GlooPeerMonitor::Snapshot GlooPeerMonitor::Read() {
  Snapshot s;
  s.peers.resize(size_);
  try {
    std::vector<std::string> keys;
    std::vector<int> ranks;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      keys.push_back(Key(r));
      ranks.push_back(r);
    }
    if (store_.check(keys)) {  // the usual case: one round trip for all
      const auto values = store_.multi_get(keys);
      for (size_t i = 0; i < ranks.size() && i < values.size(); ++i) s.peers[ranks[i]] = Heartbeat::Parse(values[i]);
    } else {  // get() blocks on a missing key: check each first
      for (size_t i = 0; i < ranks.size(); ++i)
        if (store_.check({keys[i]})) s.peers[ranks[i]] = Heartbeat::Parse(store_.get(keys[i]));
    }
    s.ok = true;
  } catch (const std::exception& e) {
    s.error = e.what();
  }
  ApplyLocalProgress(&s);
  s.wall_ms = WallClockMs();
  return s;
}

std::vector<std::optional<Heartbeat>> GlooPeerMonitor::ReadPeers() {
  Snapshot s = Read();
  if (!s.ok) throw std::runtime_error(s.error);
  return std::move(s.peers);
}

bool GlooPeerMonitor::FreshRead(std::unique_lock<std::mutex>& lock, Snapshot* out) {
  if (exited_) return false;
  const int64_t request = ++reads_requested_;
  cv_.notify_all();
  if (!cv_.wait_for(lock, kReadWait, [&] { return reads_done_ >= request || exited_; }) || reads_done_ < request) {
    return false;
  }
  *out = latest_;
  return true;
}

void GlooPeerMonitor::Judge(const Snapshot& snap, bool fresh, int64_t seq, int64_t issued_ms, const char* op,
                            bool timed_out, std::vector<std::string>* findings, std::vector<int>* reached,
                            std::vector<int>* alive) const {
  const bool have = fresh && snap.ok;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const std::optional<Heartbeat>& h = have ? snap.peers[r] : known_[r];
    if (!h) {
      if (have) findings->push_back(Rank(r) + " has published no heartbeat (it died early, or runs without heartbeats)");
      continue;
    }
    const bool local = h->host == host_ && h->pid != pid_;
    if (h->closed) {
      findings->push_back(internal::StrCat(Rank(r), " has closed its communicator (", h->Progress(), ")"));
    } else if (local && local_host::ProcessGone(h->pid)) {
      findings->push_back(internal::StrCat(Rank(r), " (pid ", h->pid, " on this host) has died",
                                           have ? " (" + h->Progress() + ")" : ""));
    } else if (!have) {
      continue;  // nothing more can be said without the store
    } else if (const int64_t age = snap.wall_ms - h->wall_ms; age > kStalePeriods * period_.count()) {
      findings->push_back(internal::StrCat(Rank(r), ": no heartbeat for ", FormatSeconds(age), " (dead or hung; ",
                                           h->Progress(), ")"));
    } else if (h->issued >= seq) {
      reached->push_back(r);
    } else if (h->wall_ms < issued_ms || !timed_out) {  // (hosts' wall clocks: NTP's skew is far below a period)
      alive->push_back(r);
    } else {
      findings->push_back(internal::StrCat(Rank(r), " is alive (heartbeat ", FormatSeconds(std::max<int64_t>(age, 0)),
                                           " ago) but has issued ", h->issued, " collectives while this rank is at #",
                                           seq, " (", op, "): it has not reached this collective",
                                           h->op == "-" ? "" : " (its latest: " + h->op + ")"));
    }
  }
  if (!fresh) {
    findings->push_back(exited_ ? "no heartbeats read: the communicator was destroyed"
                                : "the rendezvous store did not answer within " + FormatSeconds(kReadWait.count()) +
                                      store_.unreachable_note);
  } else if (!snap.ok) {
    findings->push_back(
        internal::StrCat("the rendezvous store could not be read (", snap.error, ")", store_.unreachable_note));
  }
}

PeerWatch::Reader BeatReader(std::shared_ptr<GlooPeerMonitor> monitor) {
  return [monitor = std::move(monitor)] {
    std::vector<std::optional<PeerBeat>> beats;
    for (const auto& h : monitor->ReadPeers()) {
      if (h) {
        beats.push_back(PeerBeat{h->wall_ms, h->issued, h->op, h->pid, h->host, h->closed, h->exact});
      } else {
        beats.push_back(std::nullopt);
      }
    }
    return beats;
  };
}

}  // namespace shardtrain::comm
