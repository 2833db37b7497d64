// The rendezvous store as the heartbeat code sees it: GlooPeerMonitor
// (comm/gloo/internal/peer_monitor.h) and StallWatch (comm/stall_watch.h)
// include no torch header and reach the store through HeartbeatStore's
// functions; this adapts a c10d::Store to them. Shared by the Gloo and NCCL
// backends (so both publish heartbeats under the same keys and format).
#ifndef SHARDTRAIN_COMM_HEARTBEAT_STORE_H_
#define SHARDTRAIN_COMM_HEARTBEAT_STORE_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/gloo/internal/peer_monitor.h"

namespace shardtrain::comm {

// `store`'s set/check/multiGet/get, their errors one line (c10's backtraces
// stripped), and for a TCPStore (also under a PrefixStore) a note naming the
// process that serves it, appended when it cannot be read.
gloo_internal::HeartbeatStore MakeHeartbeatStore(const c10::intrusive_ptr<c10d::Store>& store);

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_HEARTBEAT_STORE_H_
