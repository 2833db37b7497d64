// The authenticated store's server loop (comm/auth_store/internal/server.h).
#include "comm/auth_store/internal/server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <optional>
#include <thread>

#include "base/errors.h"
#include "base/logging.h"
#include "comm/auth_store/internal/key_value.h"
#include "comm/auth_store/internal/protocol.h"

namespace shardtrain::comm::auth_store {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxPendingHandshakes = 128;  // connections not yet authenticated
constexpr int kMaxLoggedRefusals = 50;         // then only counted
constexpr size_t kReadChunk = 64 << 10;

// One client connection.
struct Conn {
  int fd = -1;
  std::string peer;  // "address:port"
  bool ready = false;  // handshake done
  bool dead = false;
  Bytes in, out;
  Bytes ns;  // the server nonce of its handshake
  std::optional<FrameSealer> sealer;
  Clock::time_point handshake_deadline;
  std::optional<Waiting> waiting;
};

std::string PeerName(const sockaddr_storage& addr, socklen_t len) {
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof host, port, sizeof port,
              NI_NUMERICHOST | NI_NUMERICSERV);
  return std::string(host) + ":" + port;
}

// What a handshake message that announces `announced` bytes was.
std::string DescribeBadHello(const Bytes& in, uint32_t announced) {
  std::string why = "announced a handshake message of " + std::to_string(announced) + " bytes (at most " +
                    std::to_string(kMaxHandshakeBytes) + "; not a client of this store)";
  static const uint8_t kC10dValidate[] = {0x00, 0xCE, 0xF7, 0x85, 0x3C};  // c10d's VALIDATE query
  if (in.size() >= sizeof kC10dValidate && std::equal(kC10dValidate, kC10dValidate + 5, in.begin())) {
    why += "; it speaks c10d's TCPStore protocol: a rank or tool run without the job's secret "
           "(SHARDTRAIN_SECRET / SHARDTRAIN_SECRET_FILE)?";
  }
  return why;
}

}  // namespace

class Server::Impl {
 public:
  explicit Impl(ServerOptions o) : o_(std::move(o)) {
    if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) ST_THROW(CommError, "store server: pipe2: ", std::strerror(errno));
    fcntl(o_.listen_fd, F_SETFL, fcntl(o_.listen_fd, F_GETFL) | O_NONBLOCK);
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    getsockname(o_.listen_fd, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
    thread_ = std::thread([this] { Run(); });
  }

  ~Impl() {
    stop_ = true;
    (void)!write(wake_[1], "x", 1);
    thread_.join();
    for (auto& c : conns_) close(c.fd);
    close(o_.listen_fd);
    close(wake_[0]);
    close(wake_[1]);
  }

  int port() const { return port_; }
  int64_t refused() const { return refused_; }
  int64_t authenticated() const { return authenticated_; }

 private:
  void Run() {
    std::vector<pollfd> fds;
    while (!stop_) {
      fds.assign({{wake_[0], POLLIN, 0}, {o_.listen_fd, POLLIN, 0}});
      for (const auto& c : conns_) {
        fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      }
      if (poll(fds.data(), fds.size(), PollTimeoutMs()) < 0 && errno != EINTR) {
        ST_LOG(ERROR) << "rendezvous store server: poll failed: " << std::strerror(errno);
        return;
      }
      if (stop_) return;
      if (fds[1].revents & POLLIN) Accept();
      size_t i = 2;
      for (auto& c : conns_) {
        if (i >= fds.size() || fds[i].fd != c.fd) break;  // accepted in this round
        const short ev = fds[i++].revents;
        if (ev & (POLLIN | POLLHUP | POLLERR)) OnReadable(c);
        if (!c.dead && (ev & POLLOUT)) Flush(c);
      }
      Expire(Clock::now());
      conns_.remove_if([](const Conn& c) {
        if (c.dead) close(c.fd);
        return c.dead;
      });
    }
  }

  int PollTimeoutMs() const {
    std::optional<Clock::time_point> next;
    for (const auto& c : conns_) {
      std::optional<Clock::time_point> d;
      if (!c.ready) d = c.handshake_deadline;
      if (c.waiting && c.waiting->deadline) d = c.waiting->deadline;
      if (d && (!next || *d < *next)) next = d;
    }
    if (!next) return 1000;
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*next - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(ms, 0, 1000));
  }

  void Accept() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      const int fd = accept4(o_.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a connection that went away
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      conns_.emplace_back();
      Conn& c = conns_.back();
      c.fd = fd;
      c.peer = PeerName(addr, len);
      const size_t pending = std::count_if(conns_.begin(), conns_.end(), [](const Conn& x) { return !x.ready; });
      if (pending > kMaxPendingHandshakes) {
        Refuse(c, "more than " + std::to_string(kMaxPendingHandshakes) + " connections are in their handshake");
        continue;
      }
      c.handshake_deadline = Clock::now() + o_.handshake_deadline;
      c.ns = RandomBytes(kNonceBytes);
      Bytes hello(kMagic, kMagic + kMagicBytes);
      Append(&hello, c.ns);
      AppendPlainFrame(hello, &c.out);
      Flush(c);
    }
  }

  void OnReadable(Conn& c) {
    uint8_t buf[kReadChunk];
    for (int round = 0; round < 16 && !c.dead; ++round) {
      const ssize_t n = recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        Append(&c.in, buf, static_cast<size_t>(n));
        if (c.in.size() > kMaxFrameBytes + 2 * kReadChunk) {
          Refuse(c, "sent more than one frame's worth while its request waits");
        }
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
      // Closed (n == 0) or reset: normal for an authenticated client that is
      // done. What a stranger sent before it hung up is judged first.
      if (!c.ready) Process(c);
      if (!c.dead && !c.ready) {
        Refuse(c, c.in.empty() ? "closed the connection without a handshake"
                                : "closed the connection in the middle of its handshake");
      }
      c.dead = true;
      return;
    }
    Process(c);
  }

  // Handles every complete frame received (none while a request waits).
  void Process(Conn& c) {
    Bytes body, tag;
    uint32_t announced = 0;
    while (!c.dead && !c.waiting) {
      const Parse p = c.ready ? TakeFrame(&c.in, kMaxFrameBytes, kTagBytes, &body, &tag, &announced)
                              : TakeFrame(&c.in, kMaxHandshakeBytes, 0, &body, &tag, &announced);
      if (p == Parse::kNeedMore) return;
      if (p == Parse::kTooLarge) {
        Refuse(c, c.ready ? "announced a frame of " + std::to_string(announced) + " bytes; at most " +
                                std::to_string(kMaxFrameBytes)
                          : DescribeBadHello(c.in, announced));
        return;
      }
      if (!c.ready) {
        OnHello(c, body);
      } else if (!c.sealer->Open(body, tag)) {
        Refuse(c, "frame #" + std::to_string(c.sealer->received()) +
                      " failed its HMAC-SHA-256 check (injected, replayed or corrupted)");
      } else {
        OnRequest(c, body);
      }
    }
  }

  void OnHello(Conn& c, const Bytes& body) {
    if (body.size() != kMagicBytes + 2 * kNonceBytes || !std::equal(kMagic, kMagic + kMagicBytes, body.begin())) {
      Refuse(c, "sent a handshake message that is not this store's (" + std::to_string(body.size()) + " bytes)");
      return;
    }
    const Bytes nc(body.begin() + kMagicBytes, body.begin() + kMagicBytes + kNonceBytes);
    const Bytes proof(body.begin() + kMagicBytes + kNonceBytes, body.end());
    if (!TagsEqual(ClientProof(o_.secret, c.ns, nc), proof.data())) {
      const std::string reason = "its proof of the job's secret does not match this store's";
      Bytes verdict = Writer(1).Take();
      Append(&verdict, reason.data(), reason.size());
      AppendPlainFrame(verdict, &c.out);
      // Counted and logged before the client can read the verdict.
      Refuse(c, reason + " (a wrong secret: not a rank of this job, or the ranks were given different secrets)");
      Flush(c);
      return;
    }
    Bytes verdict = Writer(0).Take();
    const Bytes ps = ServerProof(o_.secret, c.ns, nc, proof);
    Append(&verdict, ps);
    AppendPlainFrame(verdict, &c.out);
    c.sealer.emplace(SessionKey(o_.secret, c.ns, nc), /*is_server=*/true);
    c.ready = true;
    ++authenticated_;
    Flush(c);
  }

  void OnRequest(Conn& c, const Bytes& body) {
    Outcome o = table_.Run(body);
    if (o.malformed) {
      Refuse(c, "sent a malformed request (" + std::to_string(body.size()) + " bytes, operation " +
                    std::to_string(body.empty() ? -1 : body[0]) + ")");
      return;
    }
    if (o.waiting) {
      c.waiting = std::move(o.waiting);
    } else {
      Send(c, o.response);
    }
    if (o.mutated) WakeWaiters();
  }

  void WakeWaiters() {
    for (auto& w : conns_) {
      if (w.dead || !w.waiting) continue;
      if (auto r = table_.TryFinish(*w.waiting)) {
        w.waiting.reset();
        Send(w, *r);
      }
    }
  }

  void Expire(Clock::time_point now) {
    for (auto& c : conns_) {
      if (c.dead) continue;
      if (!c.ready && now >= c.handshake_deadline) {
        Refuse(c, "did not complete the handshake within " + std::to_string(o_.handshake_deadline.count()) +
                      " ms (" + std::to_string(c.in.size()) + " bytes received)");
      } else if (c.waiting && c.waiting->deadline && now >= *c.waiting->deadline) {
        c.waiting.reset();
        Send(c, KeyValueTable::TimedOut());
      }
      if (!c.dead && !c.waiting && !c.in.empty()) Process(c);  // input that arrived while it waited
    }
  }

  void Send(Conn& c, const Bytes& body) {
    c.sealer->Seal(body, &c.out);
    Flush(c);
  }

  void Flush(Conn& c) {
    size_t sent = 0;
    while (sent < c.out.size()) {
      const ssize_t n = send(c.fd, c.out.data() + sent, c.out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;  // the client went away
        break;
      }
    }
    c.out.erase(c.out.begin(), c.out.begin() + static_cast<std::ptrdiff_t>(sent));
  }

  // Closes a connection for a fault; logs the first kMaxLoggedRefusals.
  void Refuse(Conn& c, const std::string& why) {
    c.dead = true;
    const int64_t n = ++refused_;
    if (n <= kMaxLoggedRefusals) {
      ST_LOG(WARNING) << "rendezvous store (port " << port_ << "): dropped the connection from " << c.peer << ": "
                      << why << (n == kMaxLoggedRefusals ? " (further drops are counted, not logged)" : "");
    }
  }

  ServerOptions o_;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> refused_{0};
  std::atomic<int64_t> authenticated_{0};
  std::list<Conn> conns_;
  KeyValueTable table_;
  std::thread thread_;
};

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Server::~Server() = default;
int Server::port() const { return impl_->port(); }
int64_t Server::refused() const { return impl_->refused(); }
int64_t Server::authenticated() const { return impl_->authenticated(); }

}  // namespace shardtrain::comm::auth_store
