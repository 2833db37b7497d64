// StallWatch: stalled-peer reports for a backend whose waits poll instead of
// blocking in a library call (the NCCL backend: its watchdog thread and its
// host-blocking Wait poll a CUDA event).
//
// It publishes this rank's heartbeat (collectives issued, the latest one) to
// the rendezvous store every `period`, with the Gloo backend's keys and
// format (GlooPeerMonitor), and runs a PeerWatch (comm/peer_watch.h) over
// the peers' heartbeats: while a collective of this rank is pending (from
// Issue() until its handle is dropped), a peer that makes no progress for
// stall_warning is named in a warning, and after stall_timeout Failure()
// holds the report, which the poller throws after aborting the group. The
// decision (who stalled, for how long) is PeerWatch's; this class only
// wires it to a polling backend. Plain C++: the store is reached through
// HeartbeatStore's functions (comm/heartbeat_store.h adapts a c10d::Store),
// so it is tested on the CPU (tests/comm/peer_watch_test.cc).
//
// Thread-safety: every method may be called from any thread. Issue() and the
// handle's destructor take PeerWatch's lock; Failure() too: callers may hold
// their own lock around them, as long as they never take it inside a
// PeerWatch callback (StallWatch registers none).
#ifndef SHARDTRAIN_COMM_STALL_WATCH_H_
#define SHARDTRAIN_COMM_STALL_WATCH_H_

#include <cstdint>
#include <memory>
#include <string>

#include "comm/gloo/internal/peer_monitor.h"
#include "comm/peer_watch.h"

namespace shardtrain::comm {

class StallWatch {
 public:
  // Starts publishing heartbeats (period: options.period, > 0) and, when
  // options.stall_warning or stall_timeout is > 0, the watch. options.size > 1.
  StallWatch(gloo_internal::HeartbeatStore store, PeerWatchOptions options);
  // Stop().
  ~StallWatch();
  StallWatch(const StallWatch&) = delete;
  StallWatch& operator=(const StallWatch&) = delete;

  // Ends the watch, publishes a last "closed" heartbeat (peers then do not
  // count this rank as stalled) and ends the heartbeat thread. Each waits at
  // most 3 s for a store that does not answer. Idempotent.
  void Stop();

  // This rank issued collective #seq (`op`: a string literal, "AllReduce").
  // Published with the next heartbeat; the collective counts as waited in
  // (for the peers' stall time) until the returned handle is destroyed;
  // null when no watch runs.
  std::unique_ptr<PeerWatch::Waiting> Issue(int64_t seq, const char* op);

  // Registers a wait in collective #seq without issuing one (a blocking wait
  // on a collective whose Issue handle was dropped); null without a watch.
  std::unique_ptr<PeerWatch::Waiting> BlockedIn(int64_t seq, const char* op);

  // The stall failure ("stalled peer: rank R ...; giving up after
  // <options>::stall_timeout = ..."), empty before stall_timeout passed.
  std::string Failure() const;
  // The latest warning's text (empty: none) and how many were logged.
  std::string LastWarning() const;
  int64_t Warnings() const;

 private:
  std::shared_ptr<GlooPeerMonitor> monitor_;
  std::unique_ptr<PeerWatch> watch_;  // null: stall_warning and stall_timeout are 0
};

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_STALL_WATCH_H_
