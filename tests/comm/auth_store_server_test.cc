// The authenticated store's server and client connections with real sockets
// (comm/auth_store/internal/): the handshake accepts the secret's holders
// and refuses a wrong secret on both sides; strangers (no handshake, garbage,
// c10d's protocol, a huge announced frame, a forged proof, silence) are each
// closed while an authenticated client's blocking wait and another
// connection's set go on; an authenticated connection's replayed or altered
// frame is refused; a server that cannot prove the secret, or says nothing,
// is refused by the client. Plain C++ (no torch).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "comm/auth_store/internal/connection.h"
#include "comm/auth_store/internal/protocol.h"
#include "comm/auth_store/internal/server.h"
#include "comm/net_address.h"
#include "tests/testing/loopback.h"

namespace shardtrain::comm::auth_store {
namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kSecret = "0123456789abcdef0123456789abcdef";

// A listening socket on a free loopback port; its port in *port.
int ListenAnywhere(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(listen(fd, 64), 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

std::unique_ptr<Server> StartServer(int* port, std::chrono::milliseconds handshake = std::chrono::seconds(10)) {
  ServerOptions o;
  o.listen_fd = ListenAnywhere(port);
  o.secret = kSecret;
  o.handshake_deadline = handshake;
  return std::make_unique<Server>(std::move(o));
}

std::unique_ptr<Connection> Open(int port, const std::string& secret = kSecret) {
  return Connection::Open("127.0.0.1", port, secret, Clock::now() + std::chrono::seconds(5), std::chrono::seconds(5));
}

int RawConnect(int port) {
  const int fd = testing::ConnectTcp("127.0.0.1", port);
  EXPECT_GE(fd, 0) << "cannot connect to 127.0.0.1:" << port;
  return fd;
}

void Send(int fd, const Bytes& b) { (void)!send(fd, b.data(), b.size(), MSG_NOSIGNAL); }

// True when the server closes `fd` within `limit` (reads and discards what it sends first).
bool ClosedByServer(int fd, std::chrono::milliseconds limit) {
  const auto end = Clock::now() + limit;
  uint8_t buf[4096];
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return true;
  }
  return false;
}

Bytes Ok(const Bytes& response) { return Bytes(response.begin(), response.begin() + (response.empty() ? 0 : 1)); }

// The server's hello, read from a raw connection: its nonce.
Bytes ReadHello(int fd) {
  Bytes in, body, tag;
  uint8_t buf[256];
  uint32_t announced = 0;
  while (TakeFrame(&in, kMaxHandshakeBytes, 0, &body, &tag, &announced) != Parse::kFrame) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return {};
    Append(&in, buf, static_cast<size_t>(n));
  }
  return Bytes(body.begin() + kMagicBytes, body.end());
}

TEST(AuthStoreServerTest, StrangersAreDroppedWhileAuthenticatedClientsWork) {
  int port = 0;
  auto server = StartServer(&port, std::chrono::milliseconds(500));
  auto waiter = Open(port);
  auto setter = Open(port);
  // A blocking wait on one connection; the set comes from another while it waits.
  std::thread waiting([&] {
    const Bytes r = waiter->Call(Writer(uint8_t(Op::kWait)).Keys({"go"}).I64(20000).Take(), std::nullopt);
    EXPECT_EQ(r, Bytes{0});
  });
  std::vector<int> strangers;
  Bytes garbage(64 << 10);
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<uint8_t>(i * 131 + 7);
  const Bytes c10d_validate = {0x00, 0xCE, 0xF7, 0x85, 0x3C, 1, 3, 0, 0, 0, 0, 0, 0, 0, 'k', 'e', 'y'};
  const Bytes huge = {0xFF, 0xFF, 0xFF, 0xFF, 'x'};
  for (const Bytes& payload : {garbage, c10d_validate, huge}) {
    strangers.push_back(RawConnect(port));
    Send(strangers.back(), payload);
  }
  // A well-formed hello with a proof made without the secret.
  strangers.push_back(RawConnect(port));
  {
    Bytes hello(kMagic, kMagic + kMagicBytes), wire;
    const Bytes rest = RandomBytes(2 * kNonceBytes);
    Append(&hello, rest);
    AppendPlainFrame(hello, &wire);
    Send(strangers.back(), wire);
  }
  strangers.push_back(RawConnect(port));  // c10d's bytes, then it hangs up: judged once, by what it sent
  Send(strangers.back(), c10d_validate);
  shutdown(strangers.back(), SHUT_WR);
  strangers.push_back(RawConnect(port));  // silent
  EXPECT_EQ(Ok(setter->Call(Writer(uint8_t(Op::kSet)).Str("go").Vec({1}).Take(), std::chrono::seconds(5))), Bytes{0});
  waiting.join();
  for (size_t i = 0; i < strangers.size(); ++i) {
    EXPECT_TRUE(ClosedByServer(strangers[i], std::chrono::seconds(5))) << "stranger " << i << " was not dropped";
    close(strangers[i]);
  }
  EXPECT_EQ(server->refused(), static_cast<int64_t>(strangers.size()));
  EXPECT_EQ(server->authenticated(), 2);
  // The authenticated connections still work.
  const Bytes got = setter->Call(Writer(uint8_t(Op::kGet)).Str("go").I64(1000).Take(), std::chrono::seconds(5));
  EXPECT_EQ(got, (Bytes{0, 1, 0, 0, 0, 1}));
}

TEST(AuthStoreServerTest, AWrongSecretIsRefusedNamingTheSecrets) {
  int port = 0;
  auto server = StartServer(&port);
  try {
    Open(port, "another secret of 32 bytes......");
    FAIL() << "a client with another secret was accepted";
  } catch (const CommError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the rendezvous store at 127.0.0.1:" + std::to_string(port) + " refused this client"),
              std::string::npos) << m;
    EXPECT_NE(m.find("SHARDTRAIN_SECRET / SHARDTRAIN_SECRET_FILE"), std::string::npos) << m;
  }
  EXPECT_EQ(server->refused(), 1);
  EXPECT_EQ(server->authenticated(), 0);
}

TEST(AuthStoreServerTest, ReplayedOrAlteredFramesCloseTheConnection) {
  int port = 0;
  auto server = StartServer(&port);
  for (const bool replay : {true, false}) {
    const int fd = RawConnect(port);
    const Bytes ns = ReadHello(fd);
    ASSERT_EQ(ns.size(), kNonceBytes);
    const Bytes nc = RandomBytes(kNonceBytes);
    const Bytes proof = ClientProof(kSecret, ns, nc);
    Bytes hello(kMagic, kMagic + kMagicBytes), wire;
    Append(&hello, nc);
    Append(&hello, proof);
    AppendPlainFrame(hello, &wire);
    FrameSealer sealer(SessionKey(kSecret, ns, nc), /*is_server=*/false);
    Bytes request;
    sealer.Seal(Writer(uint8_t(Op::kSet)).Str("k").Vec({7}).Take(), &request);
    Append(&wire, request);
    if (replay) {
      Append(&wire, request);  // the same frame again
    } else {
      Bytes next;  // the next frame in sequence, one bit of its key flipped
      sealer.Seal(Writer(uint8_t(Op::kSet)).Str("k").Vec({8}).Take(), &next);
      next[4 + 1 + 4] ^= 1;
      Append(&wire, next);
    }
    Send(fd, wire);
    EXPECT_TRUE(ClosedByServer(fd, std::chrono::seconds(5))) << (replay ? "a replayed" : "an altered") << " frame";
    close(fd);
  }
  EXPECT_EQ(server->authenticated(), 2);
  EXPECT_EQ(server->refused(), 2);
}

TEST(AuthStoreServerTest, AServerWithoutTheSecretOrSilentIsRefusedByTheClient) {
  int port = 0;
  const int fd = ListenAnywhere(&port);
  for (const bool silent : {false, true}) {
    std::thread fake([&] {
      const int c = accept(fd, nullptr, nullptr);
      Bytes wire;
      if (!silent) {
        Bytes hello(kMagic, kMagic + kMagicBytes);
        const Bytes ns = RandomBytes(kNonceBytes);
        Append(&hello, ns);
        AppendPlainFrame(hello, &wire);
        Bytes verdict = {0};
        const Bytes forged = RandomBytes(kTagBytes);
        Append(&verdict, forged);
        AppendPlainFrame(verdict, &wire);
        Send(c, wire);
      }
      ClosedByServer(c, std::chrono::seconds(3));  // until the client hangs up
      close(c);
    });
    try {
      Connection::Open("127.0.0.1", port, kSecret, Clock::now() + std::chrono::seconds(5),
                       std::chrono::milliseconds(300));
      ADD_FAILURE() << "the client accepted a server without the secret";
    } catch (const CommError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(silent ? "sent no greeting within 300 ms" : "did not prove that it holds this job's secret"),
                std::string::npos) << m;
    }
    fake.join();
  }
  close(fd);
}

}  // namespace
}  // namespace shardtrain::comm::auth_store
