// The authenticated store's server: one thread that serves every connection
// from a poll() loop over non-blocking sockets, so no client (slow, silent or
// hostile) can block another. A connection must complete the handshake
// (comm/auth_store/internal/protocol.h) within `handshake_deadline`; one that
// fails it, sends a malformed or oversized frame, or a frame whose HMAC does
// not verify is closed and logged once (its address and what was wrong).
// Plain C++.
#ifndef SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_SERVER_H_
#define SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_SERVER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace shardtrain::comm::auth_store {

inline constexpr std::chrono::milliseconds kDefaultHandshakeDeadline = std::chrono::seconds(10);

struct ServerOptions {
  int listen_fd = -1;  // a listening socket (comm/net_address.h ListenOn); the server owns it
  std::string secret;  // the job's shared secret
  std::chrono::milliseconds handshake_deadline = kDefaultHandshakeDeadline;
};

class Server {
 public:
  // Starts serving on its own thread.
  explicit Server(ServerOptions options);
  // Stops the thread and closes every connection and the listening socket.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The port it listens on.
  int port() const;
  // Connections closed for a fault so far (failed handshake, bad frame, ...).
  int64_t refused() const;
  // Connections that completed the handshake so far.
  int64_t authenticated() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardtrain::comm::auth_store

#endif  // SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_SERVER_H_
