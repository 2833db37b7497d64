// Internal to the comm backends (the Gloo backend, and the NCCL backend's
// StallWatch: comm/stall_watch.h); not part of the public API.
//
// GlooPeerMonitor: this rank's heartbeat in the rendezvous store, and the
// diagnosis of a failed collective from the peers' heartbeats (which rank is
// dead, hung, closed, or behind). Plain C++: the store is reached through
// HeartbeatStore's functions, so this part includes no torch header.
#ifndef SHARDTRAIN_COMM_GLOO_INTERNAL_PEER_MONITOR_H_
#define SHARDTRAIN_COMM_GLOO_INTERNAL_PEER_MONITOR_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/peer_watch.h"

namespace shardtrain::comm {
namespace gloo_internal {

// The store operations the monitor uses. Each may throw std::exception whose
// what() is one line (the caller strips c10's backtraces).
struct HeartbeatStore {
  std::function<void(const std::string& key, const std::string& value)> set;
  std::function<bool(const std::vector<std::string>& keys)> check;
  std::function<std::vector<std::string>(const std::vector<std::string>& keys)> multi_get;
  std::function<std::string(const std::string& key)> get;
  // Appended when the store cannot be read: which process serves it ("" if unknown).
  std::string unreachable_note;
};

// One rank's heartbeat as published in the store, one line of text:
//   "<wall ms> <collectives issued> <latest op or -> <pid> <host id> <up|closed>"
struct Heartbeat {
  int64_t wall_ms = 0;
  int64_t issued = 0;
  std::string op = "-";
  int64_t pid = 0;
  std::string host;
  bool closed = false;
  // `issued` and `op` were read from shared memory (GlooPeerMonitor::SetLocalProgress),
  // exact now, instead of from the heartbeat (as old as the heartbeat). Not published.
  bool exact = false;

  std::string Format() const;
  static std::optional<Heartbeat> Parse(const std::string& text);
  // "41 collectives issued, the latest AllGather"
  std::string Progress() const;
};

}  // namespace gloo_internal

// Publishes this rank's heartbeat to the store every `period` from a
// background thread, and explains failures from the peers' heartbeats.
//
// Failure diagnosis reads the peers' records through the same thread (so a
// dead or unresponsive store never blocks the failing collective for more than
// kReadWait) and names, per peer: a closed communicator, a dead process (pid
// check, same host only), a heartbeat older than 3 periods (dead or hung), or a
// live rank that has not issued the failed collective yet. The thread and its
// state are shared-owned, so a thread stuck in an unresponsive store can be
// left behind (detached) by Stop() without dangling references.
class GlooPeerMonitor : public std::enable_shared_from_this<GlooPeerMonitor> {
 public:
  GlooPeerMonitor(gloo_internal::HeartbeatStore store, std::string group, int rank, int size,
                  std::chrono::milliseconds period);
  ~GlooPeerMonitor();

  void Start();

  // Records that this rank issued collective #seq, `op` (a string literal: "AllGather", ...).
  void Note(int64_t seq, const char* op) {
    last_op_.store(op, std::memory_order_relaxed);
    issued_.store(seq, std::memory_order_release);
  }

  // Where a peer's exact progress can be read now (the shared-memory mesh):
  // (collectives issued, the latest op's title: a string literal) or nullopt.
  // Every read of the peers' heartbeats then takes the count from it: a
  // heartbeat is up to a period old, and a stopped process publishes none.
  // Called under a lock of its own; Stop() drops it, so whatever it reads
  // may go once Stop() returned.
  using LocalProgress = std::function<std::optional<std::pair<int64_t, const char*>>(int rank)>;
  void SetLocalProgress(LocalProgress fn);

  // Publishes a last "closed" heartbeat and ends the thread. Waits at most
  // kStopWait (a thread stuck in an unresponsive store is detached).
  void Stop();

  // Explains why collective #seq (`op`, issued at wall time `issued_ms`)
  // failed, naming the peers at fault. Never blocks for much longer than
  // kReadWait (plus 1.5 periods when the first look finds no culprit after a
  // connection failure).
  std::string Diagnose(int64_t seq, int64_t issued_ms, const char* op, bool timed_out);

  // The peers' latest heartbeats, read from the store now on the caller's
  // thread (index = rank; nullopt for this rank and for a peer that has not
  // published one yet). For PeerWatch, which reads while a collective waits.
  // Throws std::runtime_error when the store cannot be read.
  std::vector<std::optional<gloo_internal::Heartbeat>> ReadPeers();

 private:
  static constexpr std::chrono::milliseconds kReadWait{2000};
  static constexpr std::chrono::milliseconds kStopWait{3000};
  static constexpr int kStalePeriods = 3;

  struct Snapshot {
    bool ok = false;
    std::string error;
    int64_t wall_ms = 0;  // when it was read
    std::vector<std::optional<gloo_internal::Heartbeat>> peers;
  };

  std::string Key(int r) const { return "shardtrain/heartbeat/" + group_ + "/" + std::to_string(r); }
  std::string Rank(int r) const;

  void Run();
  void Publish(bool closed);
  Snapshot Read();
  // Overrides the peers' counts in `s` with local_progress_'s.
  void ApplyLocalProgress(Snapshot* s);
  // Asks the thread for a read that starts after this call and waits for it at
  // most kReadWait. False (and `out` untouched) if none came.
  bool FreshRead(std::unique_lock<std::mutex>& lock, Snapshot* out);
  // After a connection failure that found no culprit: looks again once a peer
  // that died a moment ago would have renewed its heartbeat. mu_ held.
  void LookAgain(std::unique_lock<std::mutex>& lock, const Snapshot& snap, std::vector<std::string>* findings,
                 std::vector<int>* reached, std::vector<int>* alive);
  // Sorts the peers: `findings` explain the failure (closed, dead, silent,
  // behind); the others are listed in `reached` (issued #seq) or `alive`
  // (their latest heartbeat predates #seq, so their progress is unknown; or
  // behind in a failure that is no timeout: a peer that closed or died caused
  // it, and a rank a moment behind, or one that issued #seq since its
  // heartbeat, is not at fault).
  void Judge(const Snapshot& snap, bool fresh, int64_t seq, int64_t issued_ms, const char* op, bool timed_out,
             std::vector<std::string>* findings, std::vector<int>* reached, std::vector<int>* alive) const;

  const gloo_internal::HeartbeatStore store_;
  const std::string group_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds period_;
  const int64_t pid_;
  const std::string host_;
  std::atomic<int64_t> issued_{0};
  std::atomic<const char*> last_op_{nullptr};

  std::mutex progress_mu_;  // guards local_progress_ (taken without mu_)
  LocalProgress local_progress_;

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  bool stop_ = false;
  bool exited_ = false;
  int64_t reads_requested_ = 0;
  int64_t reads_done_ = 0;
  Snapshot latest_;                                             // the latest requested read
  std::vector<std::optional<gloo_internal::Heartbeat>> known_;  // each rank's latest record seen (pids when the store is gone)
  std::thread thread_;
};

// PeerWatch's view of the peers' heartbeats: `monitor`'s ReadPeers() on the
// watch's thread (with the exact counts of SetLocalProgress, when set).
PeerWatch::Reader BeatReader(std::shared_ptr<GlooPeerMonitor> monitor);

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_GLOO_INTERNAL_PEER_MONITOR_H_
