// The authenticated store's c10d::Store client (comm/auth_store.h).
#include "comm/auth_store.h"

#include <memory>
#include <mutex>
#include <vector>

#include "base/errors.h"
#include "comm/auth_store/internal/connection.h"
#include "comm/auth_store/internal/protocol.h"
#include "comm/auth_store/internal/server.h"
#include "comm/net_address.h"
#include "comm/signed_store.h"

namespace shardtrain::comm {
namespace {

using auth_store::Bytes;
using auth_store::Op;
using auth_store::Reader;
using auth_store::Status;
using auth_store::Writer;
using Clock = std::chrono::steady_clock;

// How much longer than an operation's own timeout a client waits for the
// server's answer before it gives up on the connection.
constexpr std::chrono::milliseconds kAnswerGrace = std::chrono::seconds(30);

// What every client of one store shares (clones included).
struct Endpoint {
  std::string host;
  int port = 0;
  std::string secret;
  std::chrono::milliseconds handshake_limit{};
  std::shared_ptr<auth_store::Server> server;  // when this process serves it
};

std::string KeyList(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 5; ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 5) out += " and " + std::to_string(keys.size() - 5) + " more";
  return out;
}

class AuthStore final : public c10d::Store {
 public:
  AuthStore(std::shared_ptr<const Endpoint> e, std::chrono::milliseconds timeout, bool first)
      : c10d::Store(timeout), e_(std::move(e)) {
    // The first client waits for the server to come up; later ones (clones,
    // pool growth) fail at once when it is gone.
    Return(Connect(first ? Clock::now() + timeout : Clock::now()));
  }

  const Endpoint& endpoint() const { return *e_; }

  c10::intrusive_ptr<c10d::Store> clone() override { return c10::make_intrusive<AuthStore>(e_, timeout_, false); }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    CheckValue(key, value);
    Quick(Writer(uint8_t(Op::kSet)).Str(key).Vec(value).Take(), "set", {key});
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    CheckValue(key, expected);
    CheckValue(key, desired);
    Bytes body = Quick(Writer(uint8_t(Op::kCompareSet)).Str(key).Vec(expected).Vec(desired).Take(), "compareSet", {key});
    return ReadValue(body, "compareSet", {key});
  }

  std::vector<uint8_t> get(const std::string& key) override {
    CheckKey(key);
    Bytes body = Blocking(Writer(uint8_t(Op::kGet)).Str(key), timeout_, "get", {key});
    return ReadValue(body, "get", {key});
  }

  int64_t add(const std::string& key, int64_t value) override {
    CheckKey(key);
    Bytes body = Quick(Writer(uint8_t(Op::kAdd)).Str(key).I64(value).Take(), "add", {key});
    Reader r(body);
    uint8_t status = 0;
    int64_t result = 0;
    if (!r.U8(&status) || !r.I64(&result)) Malformed("add", {key});
    return result;
  }

  bool deleteKey(const std::string& key) override {
    CheckKey(key);
    return Flag(Quick(Writer(uint8_t(Op::kDelete)).Str(key).Take(), "deleteKey", {key}), "deleteKey", {key});
  }

  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) CheckKey(k);
    return Flag(Quick(Writer(uint8_t(Op::kCheck)).Keys(keys).Take(), "check", keys), "check", keys);
  }

  int64_t getNumKeys() override {
    Bytes body = Quick(Writer(uint8_t(Op::kNumKeys)).Take(), "getNumKeys", {});
    Reader r(body);
    uint8_t status = 0;
    int64_t n = 0;
    if (!r.U8(&status) || !r.I64(&n)) Malformed("getNumKeys", {});
    return n;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const auto& k : keys) CheckKey(k);
    Blocking(Writer(uint8_t(Op::kWait)).Keys(keys), timeout, "wait", keys);
  }

  void append(const std::string& key, const std::vector<uint8_t>& value) override {
    CheckValue(key, value);
    Quick(Writer(uint8_t(Op::kAppend)).Str(key).Vec(value).Take(), "append", {key});
  }

  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) CheckKey(k);
    Bytes body = Blocking(Writer(uint8_t(Op::kMultiGet)).Keys(keys), timeout_, "multiGet", keys);
    Reader r(body);
    uint8_t status = 0;
    uint32_t n = 0;
    if (!r.U8(&status) || !r.U32(&n) || n != keys.size()) Malformed("multiGet", keys);
    std::vector<std::vector<uint8_t>> values(n);
    for (auto& v : values) {
      if (!r.Blob(auth_store::kMaxValueBytes, &v)) Malformed("multiGet", keys);
    }
    return values;
  }

  void multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) override {
    ST_CHECK_ARG(keys.size() == values.size(), "store multiSet: ", keys.size(), " keys but ", values.size(),
                 " values; valid: one value per key");
    Writer w(uint8_t(Op::kMultiSet));
    w.Keys(keys).U32(static_cast<uint32_t>(values.size()));
    size_t total = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      CheckValue(keys[i], values[i]);
      total += keys[i].size() + values[i].size() + 8;
      w.Vec(values[i]);
    }
    ST_CHECK_ARG(total + 16 <= auth_store::kMaxFrameBytes, "store multiSet: ", total, " bytes in one request; at most ",
                 auth_store::kMaxFrameBytes);
    Quick(w.Take(), "multiSet", keys);
  }

  bool hasExtendedApi() const override { return true; }

 private:
  std::unique_ptr<auth_store::Connection> Connect(Clock::time_point retry_until) {
    return auth_store::Connection::Open(e_->host, e_->port, e_->secret, retry_until, e_->handshake_limit);
  }

  void Return(std::unique_ptr<auth_store::Connection> c) {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(c));
  }

  // One request on an idle connection (a new one when every connection is
  // busy in another thread); a connection that failed is dropped.
  Bytes Call(const Bytes& request, std::optional<std::chrono::milliseconds> limit) {
    std::unique_ptr<auth_store::Connection> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        c = std::move(idle_.back());
        idle_.pop_back();
      }
    }
    if (!c) c = Connect(Clock::now());
    Bytes response = c->Call(request, limit);
    Return(std::move(c));
    return response;
  }

  // An operation the server answers at once.
  Bytes Quick(const Bytes& request, const char* what, const std::vector<std::string>& keys) {
    std::optional<std::chrono::milliseconds> limit;
    if (timeout_ > std::chrono::milliseconds::zero()) limit = timeout_ + kAnswerGrace;
    return Checked(Call(request, limit), what, keys, timeout_);
  }

  // An operation that waits for its keys on the server for `timeout` (0: forever).
  Bytes Blocking(Writer& w, std::chrono::milliseconds timeout, const char* what, const std::vector<std::string>& keys) {
    std::optional<std::chrono::milliseconds> limit;
    if (timeout > std::chrono::milliseconds::zero()) limit = timeout + kAnswerGrace;
    return Checked(Call(w.I64(timeout.count()).Take(), limit), what, keys, timeout);
  }

  Bytes Checked(Bytes response, const char* what, const std::vector<std::string>& keys,
                std::chrono::milliseconds timeout) const {
    Reader r(response);
    uint8_t status = 0;
    if (!r.U8(&status)) Malformed(what, keys);
    if (status == uint8_t(Status::kOk)) return response;
    if (status == uint8_t(Status::kTimeout)) {
      ST_THROW(CommTimeoutError, "rendezvous store at ", e_->host, ":", e_->port, ": ", what, " of ", KeyList(keys),
               " timed out after ", timeout.count(), " ms: no rank set ", keys.size() == 1 ? "it" : "them",
               " (a rank has not reached this point, or has died)");
    }
    std::string message;
    r.Str(1 << 16, &message);
    ST_THROW(CommError, "rendezvous store at ", e_->host, ":", e_->port, ": ", what, " failed: ", message);
  }

  bool Flag(const Bytes& body, const char* what, const std::vector<std::string>& keys) const {
    Reader r(body);
    uint8_t status = 0, flag = 0;
    if (!r.U8(&status) || !r.U8(&flag)) Malformed(what, keys);
    return flag != 0;
  }

  Bytes ReadValue(const Bytes& body, const char* what, const std::vector<std::string>& keys) const {
    Reader r(body);
    uint8_t status = 0;
    Bytes value;
    if (!r.U8(&status) || !r.Blob(auth_store::kMaxValueBytes, &value)) Malformed(what, keys);
    return value;
  }

  [[noreturn]] void Malformed(const char* what, const std::vector<std::string>& keys) const {
    ST_THROW(CommError, "rendezvous store at ", e_->host, ":", e_->port, ": a malformed answer to ", what, " of ",
             KeyList(keys));
  }

  static void CheckKey(const std::string& key) {
    ST_CHECK_ARG(key.size() <= auth_store::kMaxKeyBytes, "store key of ", key.size(), " bytes; at most ",
                 auth_store::kMaxKeyBytes);
  }
  static void CheckValue(const std::string& key, const std::vector<uint8_t>& value) {
    CheckKey(key);
    ST_CHECK_ARG(value.size() <= auth_store::kMaxValueBytes, "store value of key '", key, "': ", value.size(),
                 " bytes; at most ", auth_store::kMaxValueBytes);
  }

  std::shared_ptr<const Endpoint> e_;
  std::mutex mu_;
  std::vector<std::unique_ptr<auth_store::Connection>> idle_;
};

}  // namespace

c10::intrusive_ptr<c10d::Store> CreateAuthStore(const AuthStoreOptions& o) {
  ST_CHECK_ARG(o.secret.size() >= kMinSecretBytes, "the store secret must be at least ", kMinSecretBytes,
               " bytes, got ", o.secret.size());
  ST_CHECK_ARG(o.port > 0 && o.port < 65536, "authenticated store: port must be in 1..65535, got ", o.port);
  ST_CHECK_ARG(o.handshake_deadline.count() > 0, "authenticated store: handshake_deadline must be > 0 ms");
  auto e = std::make_shared<Endpoint>();
  e->host = o.host;
  e->port = o.port;
  e->secret = o.secret;
  e->handshake_limit = o.handshake_deadline;
  if (o.serve) {
    auth_store::ServerOptions so;
    so.listen_fd = ListenOn(o.bind_address.empty() ? o.host : o.bind_address, o.port);
    so.secret = o.secret;
    so.handshake_deadline = o.handshake_deadline;
    e->server = std::make_shared<auth_store::Server>(std::move(so));
    e->port = e->server->port();
  }
  return c10::make_intrusive<AuthStore>(std::move(e), o.timeout, /*first=*/true);
}

std::optional<StoreServerAddress> AuthStoreServerAddress(const c10d::Store& store) {
  const auto* s = dynamic_cast<const AuthStore*>(&store);
  if (s == nullptr) return std::nullopt;
  return StoreServerAddress{s->endpoint().host, s->endpoint().port};
}

int64_t AuthStoreDropped(const c10d::Store& store) {
  const auto* s = dynamic_cast<const AuthStore*>(&store);
  return s != nullptr && s->endpoint().server ? s->endpoint().server->refused() : -1;
}

int64_t AuthStoreAuthenticated(const c10d::Store& store) {
  const auto* s = dynamic_cast<const AuthStore*>(&store);
  return s != nullptr && s->endpoint().server ? s->endpoint().server->authenticated() : -1;
}

}  // namespace shardtrain::comm
