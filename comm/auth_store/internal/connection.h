// One authenticated client connection to the store's server: connect, the
// handshake (comm/auth_store/internal/protocol.h), then one request at a
// time. Blocking and not thread-safe: the store's client keeps a pool of them
// so that threads never wait behind another thread's blocking request.
// Plain C++.
#ifndef SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_CONNECTION_H_
#define SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_CONNECTION_H_

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "comm/auth_store/internal/protocol.h"

namespace shardtrain::comm::auth_store {

class Connection {
 public:
  // Connects to `host`:`port` (retrying a refused connection until
  // `retry_until`: the server may not listen yet) and authenticates with
  // `secret`, waiting at most `handshake_limit` for each handshake message.
  // Throws CommError naming the store and what was wrong: unreachable, not
  // this kind of store, a wrong secret on either side.
  static std::unique_ptr<Connection> Open(const std::string& host, int port, const std::string& secret,
                                          std::chrono::steady_clock::time_point retry_until,
                                          std::chrono::milliseconds handshake_limit);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Sends one request body and returns the response body, waiting at most
  // `limit` for it (nullopt: forever). Throws CommError when the connection
  // fails; it is then unusable.
  Bytes Call(const Bytes& request, std::optional<std::chrono::milliseconds> limit);

  // "host:port" of the store.
  const std::string& where() const { return where_; }

 private:
  Connection(int fd, std::string where, std::string session_key);
  int fd_;
  std::string where_;
  FrameSealer sealer_;
  Bytes in_;
};

}  // namespace shardtrain::comm::auth_store

#endif  // SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_CONNECTION_H_
