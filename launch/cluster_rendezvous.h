// The rendezvous of a detected job: ClusterInfo (launch/cluster_environment.h)
// -> comm::RendezvousOptions (comm/rendezvous.h), in one place, so the
// trainer, benchmarks and test workers meet the other ranks the same way
// (rank, world size, master address and port, and under torchrun its agent
// store and restart count).
#ifndef SHARDTRAIN_LAUNCH_CLUSTER_RENDEZVOUS_H_
#define SHARDTRAIN_LAUNCH_CLUSTER_RENDEZVOUS_H_

#include "comm/rendezvous.h"
#include "launch/cluster_environment.h"

namespace shardtrain {

// TCPStore rendezvous options for the job `info` describes (kind "tcp", the
// default timeout, the store secret from SHARDTRAIN_SECRET or
// SHARDTRAIN_SECRET_FILE, comm/signed_store.h; callers may change kind,
// file_path or timeout afterwards).
comm::RendezvousOptions RendezvousOptionsFor(const ClusterInfo& info);

}  // namespace shardtrain

#endif  // SHARDTRAIN_LAUNCH_CLUSTER_RENDEZVOUS_H_
