// The authenticated store (comm/auth_store.h) as the job sees it: W=3
// threads-as-ranks reach it through CreateStore with a secret and do every
// store operation, including a blocking wait and a set from two threads on
// one client; strangers (no secret, a wrong secret, garbage, c10d's protocol,
// a huge announced frame, silence) are each dropped while the ranks complete
// a rendezvous and a real Gloo all-reduce; a rank given another secret fails
// at once naming the secrets; CreateStore picks the store by secret and agent.
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "comm/auth_store.h"
#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"
#include "comm/signed_store.h"
#include "tests/testing/loopback.h"

namespace shardtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kAuthSecret = "0123456789abcdef0123456789abcdef";
constexpr int kWorld = 3;

RendezvousOptions AuthTcp(int rank, int port, const std::string& secret = kAuthSecret) {
  RendezvousOptions o;
  o.rank = rank;
  o.world_size = kWorld;
  o.master_port = port;
  o.timeout = std::chrono::seconds(20);
  o.secret = secret;
  return o;
}

std::vector<uint8_t> AuthBytes(const std::string& s) { return {s.begin(), s.end()}; }

int RawConnect(int port) {
  const int fd = testing::ConnectTcp("127.0.0.1", port);
  EXPECT_GE(fd, 0) << "cannot connect to 127.0.0.1:" << port;
  return fd;
}

// True when the peer closes `fd` within `limit` (what it sends first is discarded).
bool ClosedByServer(int fd, std::chrono::milliseconds limit) {
  const auto end = Clock::now() + limit;
  uint8_t buf[4096];
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) > 0 && recv(fd, buf, sizeof buf, 0) <= 0) return true;
  }
  return false;
}

void RankOperations(int rank, c10d::Store& s) {
  const std::string me = std::to_string(rank);
  s.set("rank/" + me, AuthBytes("hello from " + me));
  s.wait({"rank/0", "rank/1", "rank/2"});
  EXPECT_EQ(s.get("rank/" + std::to_string((rank + 1) % kWorld)),
            AuthBytes("hello from " + std::to_string((rank + 1) % kWorld)));
  const auto all = s.multiGet({"rank/0", "rank/1", "rank/2"});
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(all[r], AuthBytes("hello from " + std::to_string(r)));
  EXPECT_TRUE(s.check({"rank/0", "rank/2"}));
  EXPECT_FALSE(s.check({"rank/0", "never"}));
  s.add("count", 1);
  s.multiSet({"ms/" + me + "/a", "ms/" + me + "/b"}, {AuthBytes("a"), AuthBytes("b")});
  EXPECT_EQ(s.get("ms/" + me + "/b"), AuthBytes("b"));
  s.append("log", AuthBytes(me));
  // compareSet: the first rank creates the key (empty expected), the others see its value.
  const auto winner = s.compareSet("cas", {}, AuthBytes("rank " + me));
  EXPECT_EQ(winner.size(), 6u);
  EXPECT_EQ(s.compareSet("cas/" + me, AuthBytes("absent"), AuthBytes("x")),
            AuthBytes("absent"));  // missing key: c10d's answer
  s.set("cas/" + me, AuthBytes("v1"));
  EXPECT_EQ(s.compareSet("cas/" + me, AuthBytes("v1"), AuthBytes("v2")), AuthBytes("v2"));
  EXPECT_EQ(s.compareSet("cas/" + me, AuthBytes("v1"), AuthBytes("v3")), AuthBytes("v2"));
  s.set("done/" + me, AuthBytes("1"));
  s.wait({"done/0", "done/1", "done/2"});
  EXPECT_EQ(s.add("count", 0), kWorld);
  EXPECT_EQ(s.get("count"), AuthBytes("3"));  // c10d keeps add() counters as decimal strings
  EXPECT_EQ(s.get("log").size(), 3u);
  EXPECT_TRUE(s.deleteKey("ms/" + me + "/a"));
  EXPECT_FALSE(s.deleteKey("ms/" + me + "/a"));
  EXPECT_GE(s.getNumKeys(), 10);
  // A bounded wait for a key nobody sets names it.
  try {
    s.wait({"never/" + me}, std::chrono::milliseconds(200));
    ADD_FAILURE() << "wait for a missing key returned";
  } catch (const CommTimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("'never/" + me + "' timed out after 200 ms"), std::string::npos) << e.what();
  }
  // One client, two threads: a blocking wait does not hold back a set.
  std::thread waiter([&] {
    try {
      s.wait({"late/" + me}, std::chrono::seconds(5));
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t0 = Clock::now();
  s.set("late/" + me, AuthBytes("now"));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2)) << "set waited behind another thread's wait";
  waiter.join();
  auto copy = s.clone();  // its own connection
  EXPECT_EQ(copy->get("late/" + me), AuthBytes("now"));
}

TEST(AuthStoreTest, EveryOperationAtThreeRanks) {
  const int port = testing::FreeLoopbackPort();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto store = CreateStore(AuthTcp(rank, port));
        ASSERT_TRUE(AuthStoreServerAddress(*store).has_value()) << "CreateStore with a secret did not authenticate";
        RankOperations(rank, *store);
        // Rank 0's server must outlive the others' last request.
        if (rank == 0) {
          store->wait({"gone/1", "gone/2"});
        } else {
          store->set("gone/" + std::to_string(rank), AuthBytes("1"));
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
}

// The strangers of the test: each connects to `port` and misbehaves. Returns their sockets.
std::vector<int> Strangers(int port, std::string* wrong_secret_error) {
  std::vector<int> fds;
  auto add = [&](const std::vector<uint8_t>& payload) {
    fds.push_back(RawConnect(port));
    if (!payload.empty()) (void)!send(fds.back(), payload.data(), payload.size(), MSG_NOSIGNAL);
  };
  std::vector<uint8_t> garbage(64 << 10);
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<uint8_t>(i * 131 + 7);
  add(garbage);
  add({0x00, 0xCE, 0xF7, 0x85, 0x3C, 1, 3, 0, 0, 0, 0, 0, 0, 0, 'k', 'e', 'y'});  // c10d: VALIDATE, then SET
  add({0xFF, 0xFF, 0xFF, 0xFF, 'x'});  // a 4 GiB frame announced
  std::vector<uint8_t> forged = {72, 0, 0, 0, 'S', 'T', 'S', 'T', 'O', 'R', 'E', '1'};  // a hello without the secret
  forged.resize(4 + 72, 0x5A);
  add(forged);
  add({});  // silent
  try {  // the store's own client with a wrong secret
    AuthStoreOptions o;
    o.port = port;
    o.secret = "another secret of 32 bytes......";
    o.timeout = std::chrono::seconds(5);
    CreateAuthStore(o);
  } catch (const CommError& e) {
    *wrong_secret_error = e.what();
  }
  return fds;
}

TEST(AuthStoreTest, StrangersAreDroppedWhileTheJobRunsGloo) {
  const int port = testing::FreeLoopbackPort();
  std::vector<double> sums(kWorld, 0);
  std::vector<int> strangers;
  std::string wrong_secret_error;
  int64_t dropped = -1;
  auto rank_body = [&](int rank) {
    c10::intrusive_ptr<c10d::Store> store;
    if (rank == 0) {  // the server, with a short handshake deadline for the silent stranger
      AuthStoreOptions o;
      o.port = port;
      o.secret = kAuthSecret;
      o.serve = true;
      o.timeout = std::chrono::seconds(20);
      o.handshake_deadline = std::chrono::milliseconds(500);
      store = CreateAuthStore(o);
      strangers = Strangers(port, &wrong_secret_error);
    } else {
      store = CreateStore(AuthTcp(rank, port));
    }
    GlooOptions go;
    go.timeout = std::chrono::seconds(20);
    go.shared_memory = false;  // every collective over Gloo's TCP pairs, whose addresses go through the store
    auto comm = GlooCommunicator::Create(store, rank, kWorld, go);
    at::Tensor t = at::full({1000}, static_cast<float>(rank + 1));
    comm->AllReduce(t)->Wait();
    comm->Barrier()->Wait();
    sums[rank] = t.sum().item<double>();
    if (rank == 0) {
      for (size_t i = 0; i < strangers.size(); ++i) {
        EXPECT_TRUE(ClosedByServer(strangers[i], std::chrono::seconds(5))) << "stranger " << i << " was not dropped";
        close(strangers[i]);
      }
      dropped = AuthStoreDropped(*store);
    }
    comm->Barrier()->Wait();
  };
  std::vector<std::thread> threads;
  for (int rank = 1; rank < kWorld; ++rank) threads.emplace_back(rank_body, rank);
  rank_body(0);
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < kWorld; ++rank) EXPECT_EQ(sums[rank], 6000) << "rank " << rank;
  EXPECT_NE(wrong_secret_error.find("refused this client"), std::string::npos) << wrong_secret_error;
  EXPECT_EQ(dropped, 6) << "garbage, c10d, huge frame, forged hello, silent, wrong secret";
}

TEST(AuthStoreTest, ARankWithAnotherSecretFailsAtOnceNamingTheSecrets) {
  const int port = testing::FreeLoopbackPort();
  auto rank0 = CreateStore(AuthTcp(0, port));
  const auto t0 = Clock::now();
  try {
    CreateStore(AuthTcp(1, port, "another secret of 32 bytes......"));
    FAIL() << "a rank with another secret joined the store";
  } catch (const CommError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the rendezvous store at 127.0.0.1:" + std::to_string(port) + " refused this client"),
              std::string::npos) << m;
    EXPECT_NE(m.find("the ranks were given different secrets (SHARDTRAIN_SECRET / SHARDTRAIN_SECRET_FILE)"),
              std::string::npos) << m;
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
}

TEST(AuthStoreTest, CreateStorePicksTheStoreBySecretAndAgent) {
  const int port = testing::FreeLoopbackPort();
  auto plain = CreateStore([&] {
    auto o = AuthTcp(0, port, "");
    o.world_size = 1;
    return o;
  }());
  EXPECT_FALSE(AuthStoreServerAddress(*plain).has_value());
  EXPECT_FALSE(SignedStoreInner(*plain));
  // torchrun's agent store stays c10d's (served here by the plain store above): signed values.
  auto agent = CreateStore([&] {
    auto o = AuthTcp(0, port);
    o.world_size = 1;
    o.agent_store = true;
    return o;
  }());
  EXPECT_TRUE(SignedStoreInner(*agent));
  ASSERT_TRUE(TcpStoreAddress(agent).has_value());
  EXPECT_EQ(TcpStoreAddress(agent)->port, port);
}

// Seconds for W=3 ranks to create their stores and a Gloo communicator (TCP
// pairs and the shared-memory mesh), through `CreateStore` with `secret`
// ("" = c10d's TCPStore), and the mean microseconds of a set+get on one client.
std::pair<double, double> RendezvousSeconds(const std::string& secret) {
  const int port = testing::FreeLoopbackPort();
  const auto t0 = Clock::now();
  double op_us = 0;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      auto store = CreateStore(AuthTcp(rank, port, secret));
      GlooOptions go;
      go.timeout = std::chrono::seconds(20);
      auto comm = GlooCommunicator::Create(store, rank, kWorld, go);
      comm->Barrier()->Wait();
      if (rank == 1) {
        const auto o0 = Clock::now();
        for (int i = 0; i < 200; ++i) {
          store->set("bench", AuthBytes("value"));
          store->get("bench");
        }
        op_us = std::chrono::duration<double, std::micro>(Clock::now() - o0).count() / 200;
      }
      comm->Barrier()->Wait();
    });
  }
  for (auto& t : threads) t.join();
  return {std::chrono::duration<double>(Clock::now() - t0).count(), op_us};
}

// Measures (prints) the authenticated store against c10d's TCPStore; asserts
// only that it is not grossly slower (the numbers are in docs/reliability.md).
TEST(AuthStoreTest, RendezvousTimeAgainstC10dTCPStore) {
  std::vector<double> ours, theirs, ours_op, theirs_op;
  for (int i = 0; i < 3; ++i) {
    const auto [t1, op1] = RendezvousSeconds(kAuthSecret);
    const auto [t2, op2] = RendezvousSeconds("");
    ours.push_back(t1);
    theirs.push_back(t2);
    ours_op.push_back(op1);
    theirs_op.push_back(op2);
  }
  for (auto* v : {&ours, &theirs, &ours_op, &theirs_op}) std::sort(v->begin(), v->end());
  std::printf("W=3 rendezvous + Gloo communicator, median of 3: authenticated store %.3f s (set+get %.0f us), "
              "c10d TCPStore %.3f s (set+get %.0f us)\n",
              ours[1], ours_op[1], theirs[1], theirs_op[1]);
  EXPECT_LT(ours[1], 3 * theirs[1] + 1.0);
}

}  // namespace
}  // namespace shardtrain::comm
