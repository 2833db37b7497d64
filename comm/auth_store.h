// The authenticated rendezvous store: a key-value store of our own, served by
// rank 0 like c10d's TCPStore, whose every client must prove that it holds
// the job's shared secret before it can read or write anything.
//
// The connection opens with a mutual HMAC-SHA-256 challenge-response (a
// fresh nonce from each side; the client proves first, then the server), and
// every later frame carries an HMAC under a per-connection session key and a
// sequence number, so an injected or replayed frame is refused (protocol:
// comm/auth_store/internal/protocol.h). A stranger that fails the handshake,
// sends a malformed or oversized frame, or stays silent past the handshake
// deadline is dropped and logged once; the server never blocks on one client.
// Values are not encrypted.
//
// The client is a c10d::Store, so Gloo, the shared-memory mesh and the
// heartbeats use it unchanged. It keeps a pool of connections: a thread
// blocked in get()/wait() never delays another thread's set() on the same
// store (c10d's TCPStore client serializes them). clone() gives a store with
// its own connections; a server started here lives as long as the store or
// any of its clones.
#ifndef SHARDTRAIN_COMM_AUTH_STORE_H_
#define SHARDTRAIN_COMM_AUTH_STORE_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>

namespace shardtrain::comm {

struct AuthStoreOptions {
  std::string host = "127.0.0.1";  // where the server is (MASTER_ADDR)
  int port = 0;                    // its port (1..65535)
  std::string secret;              // the job's shared secret (>= 16 bytes)
  // Serve the store in this process (rank 0), listening on `bind_address`
  // (empty: `host`; "*": every interface; comm/net_address.h ListenOn).
  bool serve = false;
  std::string bind_address;
  // How long to wait for the server to come up, and each operation's default
  // timeout (c10d's Store::getTimeout).
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // How long a connection may take for its handshake (either side).
  std::chrono::milliseconds handshake_deadline = std::chrono::seconds(10);
};

// Starts the server when `serve`, then connects and authenticates. Throws
// InvalidArgumentError for bad options, CommError when the store cannot be
// reached in time or the handshake fails (naming what was wrong, e.g. "the
// rendezvous store at H:P refused this client: ... the ranks were given
// different secrets (SHARDTRAIN_SECRET / SHARDTRAIN_SECRET_FILE) ...").
c10::intrusive_ptr<c10d::Store> CreateAuthStore(const AuthStoreOptions& options);

// Where an authenticated store's server is, for a store made by
// CreateAuthStore (or its clone); nullopt for any other store.
struct StoreServerAddress {
  std::string host;
  int port = 0;
};
std::optional<StoreServerAddress> AuthStoreServerAddress(const c10d::Store& store);

// Connections the server of `store` (when this process serves it) has
// dropped for a fault, and has authenticated; -1 when it serves none.
int64_t AuthStoreDropped(const c10d::Store& store);
int64_t AuthStoreAuthenticated(const c10d::Store& store);

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_AUTH_STORE_H_
