#include "launch/cluster_rendezvous.h"

#include "comm/signed_store.h"

namespace shardtrain {

comm::RendezvousOptions RendezvousOptionsFor(const ClusterInfo& info) {
  comm::RendezvousOptions o;
  o.kind = "tcp";
  o.rank = info.rank;
  o.world_size = info.world_size;
  o.master_addr = info.master_addr;
  o.master_port = info.master_port;
  o.agent_store = info.agent_store;
  o.restart_count = info.restart_count;
  o.secret = comm::StoreSecretFromEnvironment();  // "" when none is set
  return o;
}

}  // namespace shardtrain
