// A client connection of the authenticated store (comm/auth_store/internal/connection.h).
#include "comm/auth_store/internal/connection.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "base/errors.h"

namespace shardtrain::comm::auth_store {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kSecretHint =
    "the ranks were given different secrets (SHARDTRAIN_SECRET / SHARDTRAIN_SECRET_FILE); valid: the same secret "
    "for every rank of the job";

// One connect to host:port; the socket, or -1 with errno set.
int ConnectOnce(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    ST_THROW(CommError, "rendezvous store: cannot resolve host '", host, "': ", gai_strerror(rc),
             " (valid: an IP address or a resolvable host name in MASTER_ADDR)");
  }
  int fd = -1, err = ECONNREFUSED;
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) {
    errno = err;
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

void WriteAll(int fd, const Bytes& bytes, const std::string& where) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ST_THROW(CommError, "the rendezvous store at ", where, " closed the connection (", std::strerror(errno),
               "): the process that serves it (rank 0) has probably exited");
    }
    sent += static_cast<size_t>(n);
  }
}

// How reading a frame ended.
enum class ReadEnd { kFrame, kTimeout, kClosed, kTooLarge };

// Reads one frame into body/tag, waiting until `deadline` (none: forever).
ReadEnd ReadFrame(int fd, Bytes* in, uint32_t max_body, size_t tag_bytes, std::optional<Clock::time_point> deadline,
                  Bytes* body, Bytes* tag) {
  uint32_t announced = 0;
  for (;;) {
    const Parse p = TakeFrame(in, max_body, tag_bytes, body, tag, &announced);
    if (p == Parse::kFrame) return ReadEnd::kFrame;
    if (p == Parse::kTooLarge) return ReadEnd::kTooLarge;
    int wait_ms = -1;
    if (deadline) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now()).count();
      if (left <= 0) return ReadEnd::kTimeout;
      wait_ms = static_cast<int>(std::min<int64_t>(left, 1 << 30));
    }
    pollfd pfd{fd, POLLIN, 0};
    const int r = poll(&pfd, 1, wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return ReadEnd::kTimeout;
    uint8_t buf[64 << 10];
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ReadEnd::kClosed;
    Append(in, buf, static_cast<size_t>(n));
  }
}

// The client's side of the handshake; returns the session key.
std::string Handshake(int fd, const std::string& where, const std::string& secret, std::chrono::milliseconds limit) {
  Bytes in, hello, tag;
  const std::string not_ours = "is not an authenticated ShardTrain store: rank 0 may serve c10d's TCPStore (run "
                               "without a secret) while this rank has one, or another program listens there; " +
                               std::string(kSecretHint);
  switch (ReadFrame(fd, &in, kMaxHandshakeBytes, 0, Clock::now() + limit, &hello, &tag)) {
    case ReadEnd::kFrame: break;
    case ReadEnd::kTimeout:
      ST_THROW(CommError, "the server at ", where, " sent no greeting within ", limit.count(), " ms: it ", not_ours);
    case ReadEnd::kClosed:
      ST_THROW(CommError, "the rendezvous store at ", where, " closed the connection before its greeting");
    case ReadEnd::kTooLarge:
      ST_THROW(CommError, "the server at ", where, " ", not_ours);
  }
  if (hello.size() != kMagicBytes + kNonceBytes || !std::equal(kMagic, kMagic + kMagicBytes, hello.begin())) {
    ST_THROW(CommError, "the server at ", where, " ", not_ours);
  }
  const Bytes ns(hello.begin() + kMagicBytes, hello.end());
  const Bytes nc = RandomBytes(kNonceBytes);
  const Bytes proof = ClientProof(secret, ns, nc);
  Bytes mine(kMagic, kMagic + kMagicBytes), wire;
  Append(&mine, nc);
  Append(&mine, proof);
  AppendPlainFrame(mine, &wire);
  WriteAll(fd, wire, where);
  Bytes verdict;
  if (ReadFrame(fd, &in, kMaxHandshakeBytes, 0, Clock::now() + limit, &verdict, &tag) != ReadEnd::kFrame ||
      verdict.empty()) {
    ST_THROW(CommError, "the rendezvous store at ", where, " closed the connection during the handshake (",
             kSecretHint, ")");
  }
  if (verdict[0] != 0) {
    ST_THROW(CommError, "the rendezvous store at ", where, " refused this client: ",
             std::string(verdict.begin() + 1, verdict.end()), ": ", kSecretHint);
  }
  if (verdict.size() != 1 + kTagBytes || !TagsEqual(ServerProof(secret, ns, nc, proof), verdict.data() + 1)) {
    ST_THROW(CommError, "the server at ", where, " did not prove that it holds this job's secret: it is another "
             "job's store or another program, or ", kSecretHint);
  }
  return SessionKey(secret, ns, nc);
}

}  // namespace

std::unique_ptr<Connection> Connection::Open(const std::string& host, int port, const std::string& secret,
                                             Clock::time_point retry_until, std::chrono::milliseconds handshake_limit) {
  const std::string where = host + ":" + std::to_string(port);
  auto pause = std::chrono::milliseconds(10);
  for (;;) {
    const int fd = ConnectOnce(host, port);
    if (fd >= 0) {
      try {
        std::string key = Handshake(fd, where, secret, handshake_limit);
        return std::unique_ptr<Connection>(new Connection(fd, where, std::move(key)));
      } catch (...) {
        close(fd);
        throw;
      }
    }
    const int err = errno;
    const bool retry = err == ECONNREFUSED || err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH;
    if (!retry || Clock::now() + pause >= retry_until) {
      ST_THROW(CommError, "cannot connect to the rendezvous store at ", where, ": ", std::strerror(err),
               " (is rank 0 running, and do MASTER_ADDR/MASTER_PORT name its address?)");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
}

Connection::Connection(int fd, std::string where, std::string session_key)
    : fd_(fd), where_(std::move(where)), sealer_(std::move(session_key), /*is_server=*/false) {}

Connection::~Connection() { close(fd_); }

Bytes Connection::Call(const Bytes& request, std::optional<std::chrono::milliseconds> limit) {
  Bytes wire, body, tag;
  sealer_.Seal(request, &wire);
  WriteAll(fd_, wire, where_);
  std::optional<Clock::time_point> deadline;
  if (limit) deadline = Clock::now() + *limit;
  switch (ReadFrame(fd_, &in_, kMaxFrameBytes, kTagBytes, deadline, &body, &tag)) {
    case ReadEnd::kFrame: break;
    case ReadEnd::kTimeout:
      ST_THROW(CommTimeoutError, "the rendezvous store at ", where_, " did not answer within ", limit->count(),
               " ms");
    case ReadEnd::kClosed:
      ST_THROW(CommError, "the rendezvous store at ", where_,
               " closed the connection: the process that serves it (rank 0) has probably exited");
    case ReadEnd::kTooLarge:
      ST_THROW(CommError, "the rendezvous store at ", where_, " sent a response over ", kMaxFrameBytes, " bytes");
  }
  if (!sealer_.Open(body, tag)) {
    ST_THROW(CommError, "a response of the rendezvous store at ", where_,
             " failed its HMAC-SHA-256 check (injected, replayed or corrupted); closing the connection");
  }
  return body;
}

}  // namespace shardtrain::comm::auth_store
