// PeerWatch: while this rank is blocked in a collective, watch the peers'
// heartbeats (GlooOptions::heartbeat_period) and name a peer that has stopped
// making progress long before the collective's timeout.
//
// A peer has made no progress for X when, for X, either its heartbeat was not
// renewed (the process is stopped, hung hard, or its host is unreachable), or
// it stayed alive but did not issue the collective this rank waits in (it is
// stuck in compute, I/O or a deadlock). X counts only time this rank spent
// blocked in collectives of the group. After `stall_warning` of no progress a
// warning naming the peer (rank, pid, host) and its last known collective is
// logged, once per stall; after `stall_timeout` (if set) the blocked
// collective, and every later one of the group, fails with CommTimeoutError
// carrying the same text. Plain C++ (no torch header).
#ifndef SHARDTRAIN_COMM_PEER_WATCH_H_
#define SHARDTRAIN_COMM_PEER_WATCH_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace shardtrain::comm {

// One peer's heartbeat as read from the store.
struct PeerBeat {
  int64_t wall_ms = 0;  // when it was published (ms since the epoch)
  int64_t issued = 0;   // collectives the peer had issued
  std::string op;       // the latest one ("-": none)
  int64_t pid = 0;
  std::string host;  // local_host::Id() of the peer
  bool closed = false;
  // `issued`/`op` are exact now (read from shared memory on this host), not
  // as of the heartbeat (which may be a period old, or stopped with the process).
  bool exact = false;
};

struct PeerWatchOptions {
  std::string group;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds period{1000};      // how often heartbeats are read while blocked
  std::chrono::milliseconds stall_warning{0};  // 0: no warning
  std::chrono::milliseconds stall_timeout{0};  // 0: never fail on a stall
  // The options struct the settings came from, named in the reports
  // ("GlooOptions", "NcclOptions").
  std::string options_name = "GlooOptions";
};

class PeerWatch {
 public:
  // Reads every rank's latest heartbeat (index = rank; nullopt: none yet).
  // Throws when the store cannot be read (the watch then stays silent).
  using Reader = std::function<std::vector<std::optional<PeerBeat>>()>;

  // Starts a background thread, idle until a wait begins.
  PeerWatch(PeerWatchOptions options, Reader read);
  // Stop().
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  // Ends the thread (detached if stuck in the store for more than 3 s) and
  // drops the stall callback. Idempotent.
  void Stop();

  // Called (on the watch thread) once a stall has lasted stall_timeout: e.g.
  // aborts a shared-memory transfer so that the blocked collective fails.
  void OnStallFailure(std::function<void()> abort);

  // The stall failure's text once stall_timeout has passed; empty before.
  std::string Failure() const;

  // The text of the latest stall warning logged (empty: none yet), and how
  // many were logged: for tests and for callers that report elsewhere.
  std::string LastWarning() const;
  int64_t Warnings() const;

  // Marks this rank as blocked in collective #seq (`op`) while alive.
  class Waiting {
   public:
    Waiting(PeerWatch* watch, int64_t seq, const char* op);  // watch may be null
    ~Waiting();
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;

   private:
    PeerWatch* watch_;
    int64_t id_ = 0;
  };

  // Blocks in collective #seq until `wait(slice)` returns (it must throw when
  // `slice` passes without completion, and `done()` then says whether the
  // collective finished after all) or `timeout` passes (wait's own error
  // propagates). With stall_timeout, waits in slices and throws
  // CommTimeoutError naming the stalled peer once a stall fails the group.
  // `watch` may be null (a plain wait(timeout)).
  static void Wait(PeerWatch* watch, int64_t seq, const char* op, std::chrono::milliseconds timeout,
                   const std::function<void(std::chrono::milliseconds slice)>& wait,
                   const std::function<bool()>& done);

  struct State;  // shared with the thread (peer_watch.cc)

 private:
  std::shared_ptr<State> state_;
};

// Validates stall settings (>= 0 each); throws InvalidArgumentError naming
// the field of `options_name` ("GlooOptions", "NcclOptions").
void CheckStallOptions(std::chrono::milliseconds stall_warning, std::chrono::milliseconds stall_timeout,
                       const char* options_name = "GlooOptions");

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_PEER_WATCH_H_
