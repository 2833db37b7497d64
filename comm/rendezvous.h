// Rendezvous: the key-value stores through which ranks find each other.
//
// tcp  — at master_addr:master_port, rank 0 serving. With a secret: the
//        authenticated store (comm/auth_store.h: every client proves the
//        secret). Without one, or with `agent_store` (torchrun's store, where
//        every rank is a client and keys live under
//        /worker/attempt_<restart count>): c10d's TCPStore, whose values are
//        signed when there is a secret (comm/signed_store.h).
// file — c10d FileStore at a shared path (one node or a shared filesystem).
// hash — c10d HashStore in this process: threads-as-ranks tests.
#ifndef SHARDTRAIN_COMM_RENDEZVOUS_H_
#define SHARDTRAIN_COMM_RENDEZVOUS_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>

#include "comm/auth_store.h"
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
  // The job's shared secret. kind "tcp" (not agent_store): every client of
  // the store must prove it (comm/auth_store.h). Otherwise every value is
  // signed and checked (comm/signed_store.h: a value a client without it
  // wrote is refused, naming the key). launch/ fills it from
  // SHARDTRAIN_SECRET(_FILE).
  std::string secret;
};

// Creates (or joins) the store. Throws InvalidArgumentError for an unknown kind
// or missing fields, CommError when the store cannot be reached in time.
c10::intrusive_ptr<c10d::Store> CreateStore(const RendezvousOptions& options);

// The host and port of the TCP store server `store` talks to (c10d's
// TCPStore or the authenticated store, seen through PrefixStore and
// SignStore); nullopt for a FileStore or HashStore.
std::optional<StoreServerAddress> TcpStoreAddress(const c10::intrusive_ptr<c10d::Store>& store);

// A HashStore to share between threads-as-ranks.
c10::intrusive_ptr<c10d::Store> CreateHashStore();

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_RENDEZVOUS_H_
