// Rendezvous: the key-value stores through which ranks find each other.
//
// tcp  — c10d TCPStore at master_addr:master_port (rank 0 serves unless
//        `agent_store`, as under torchrun, where every rank is a client and
//        keys live under /worker/attempt_<restart count>).
// file — c10d FileStore at a shared path (one node or a shared filesystem).
// hash — c10d HashStore in this process: threads-as-ranks tests.
#ifndef SHARDTRAIN_COMM_RENDEZVOUS_H_
#define SHARDTRAIN_COMM_RENDEZVOUS_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include "comm/communicator.h"

namespace shardtrain::comm {

struct RendezvousOptions {
  std::string kind = "tcp";  // "tcp", "file" or "hash"
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Where rank 0's TCPStore listens: empty = master_addr itself (the address
  // the cluster environment gives; loopback for a single-host run, so nothing
  // outside this machine can reach the store); "*" = every interface (only
  // when asked); else an address or host name of this machine.
  std::string bind_address;
  bool agent_store = false;  // torchrun's TORCHELASTIC_USE_AGENT_STORE
  int restart_count = 0;     // TORCHELASTIC_RESTART_COUNT
  std::string file_path;     // kind == "file"
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // The job's shared secret: when set, every value is signed and checked
  // (comm/signed_store.h: a value a client without it wrote is refused,
  // naming the key). launch/ fills it from SHARDTRAIN_SECRET(_FILE).
  std::string secret;
};

// Creates (or joins) the store. Throws InvalidArgumentError for an unknown kind
// or missing fields, CommError when the store cannot be reached in time.
c10::intrusive_ptr<c10d::Store> CreateStore(const RendezvousOptions& options);

// A HashStore to share between threads-as-ranks.
c10::intrusive_ptr<c10d::Store> CreateHashStore();

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_RENDEZVOUS_H_
