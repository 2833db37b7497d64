// The authenticated store's keys and values, and the requests that read and
// write them (decoded from a request body, answered with a response body).
// Single-threaded: the server's loop owns it. Plain C++.
#ifndef SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_KEY_VALUE_H_
#define SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_KEY_VALUE_H_

#include <chrono>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "comm/auth_store/internal/protocol.h"

namespace shardtrain::comm::auth_store {

// A request that waits for keys to exist (get, wait, multiGet).
struct Waiting {
  Op op = Op::kWait;
  std::vector<std::string> keys;
  std::optional<std::chrono::steady_clock::time_point> deadline;  // none: forever
};

// What running one request did.
struct Outcome {
  bool malformed = false;  // the body is not a valid request: close the connection
  bool mutated = false;    // keys were written or deleted: wake the waiters
  std::optional<Waiting> waiting;  // set: no response yet, wait for its keys
  Bytes response;          // the response when not waiting
};

class KeyValueTable {
 public:
  // Runs one request body.
  Outcome Run(const Bytes& request);
  // The response to a waiting request once all its keys exist, else nullopt.
  std::optional<Bytes> TryFinish(const Waiting& waiting) const;
  // The response to a waiting request whose deadline passed.
  static Bytes TimedOut();

 private:
  Outcome RunWrite(Op op, Reader& r);
  Outcome RunRead(Op op, Reader& r);
  Outcome Add(Reader& r);
  Outcome CompareSet(Reader& r);

  std::unordered_map<std::string, Bytes> values_;
};

}  // namespace shardtrain::comm::auth_store

#endif  // SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_KEY_VALUE_H_
