// The rendezvous store against strangers, with real sockets: rank 0's TCPStore
// listens only on the address it is given (not every interface), and a
// stranger that connects and sends garbage, a huge length prefix or nothing is
// dropped without disturbing two ranks' Gloo collectives; the store does not
// allocate memory from a stranger's length prefix. Also the stall watch
// (comm/peer_watch.h) with threads-as-ranks.
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/net_address.h"
#include "comm/rendezvous.h"
#include "tests/testing/loopback.h"
#include "tests/testing/skip.h"

namespace shardtrain::comm {
namespace {

int FreePort() { return testing::FreeLoopbackPort(); }

// A stranger's connection to `ip`:`port` (-1 if refused).
int Connect(const std::string& ip, int port) { return testing::ConnectTcp(ip, port); }

void Send(int fd, const std::vector<uint8_t>& bytes) {
  (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
}

// This process's peak resident memory (VmHWM), in MiB.
int64_t PeakRssMiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) / 1024;
  return -1;
}

RendezvousOptions Tcp(int rank, int port) {
  RendezvousOptions o;
  o.kind = "tcp";
  o.rank = rank;
  o.world_size = 2;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.timeout = std::chrono::seconds(20);
  return o;
}

// c10d's wire format: a query type byte, then (VALIDATE) a u32 magic, or
// (SET) u64-length-prefixed key and value.
std::vector<uint8_t> Validate() { return {0, 0xCE, 0xF7, 0x85, 0x3C}; }
std::vector<uint8_t> HugeSet() {
  std::vector<uint8_t> b = {1};
  for (int i = 0; i < 7; ++i) b.push_back(0xFF);
  b.push_back(0x7F);  // key length 2^63 - 1
  b.insert(b.end(), 64, 'k');
  return b;
}

TEST(StoreTest, StrangersSendingGarbageAreDroppedAndCollectivesComplete) {
  const int port = FreePort();
  const int64_t rss_before = PeakRssMiB();
  std::vector<int> strangers;
  std::vector<double> sums(2, 0);
  auto rank_body = [&](int rank) {
    auto store = CreateStore(Tcp(rank, port));
    if (rank == 0) {
      // Before the ranks connect Gloo: garbage, an unvalidated huge length,
      // a validated huge length, and a silent connection kept open.
      std::vector<uint8_t> garbage(64 << 10);
      for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<uint8_t>(i * 131 + 7);
      for (const auto& payload : {garbage, HugeSet(), [] {
                                    auto v = Validate();
                                    auto h = HugeSet();
                                    v.insert(v.end(), h.begin(), h.end());
                                    return v;
                                  }()}) {
        const int fd = Connect("127.0.0.1", port);
        ASSERT_GE(fd, 0);
        Send(fd, payload);
        strangers.push_back(fd);
      }
      const int silent = Connect("127.0.0.1", port);
      ASSERT_GE(silent, 0);
      strangers.push_back(silent);
    }
    GlooOptions go;
    go.timeout = std::chrono::seconds(20);
    go.shared_memory = false;  // the store carries Gloo's own rendezvous
    auto comm = GlooCommunicator::Create(store, rank, 2, go);
    at::Tensor t = at::full({1000}, static_cast<float>(rank + 1));
    comm->AllReduce(t)->Wait();
    comm->Barrier()->Wait();
    sums[rank] = t.sum().item<double>();
    store->set("after/" + std::to_string(rank), std::vector<uint8_t>{1});
    EXPECT_EQ(store->get("after/" + std::to_string(1 - rank)), std::vector<uint8_t>{1});
    comm->Barrier()->Wait();
  };
  std::thread r1(rank_body, 1);
  rank_body(0);
  r1.join();
  for (int fd : strangers) close(fd);
  EXPECT_EQ(sums[0], 3000);
  EXPECT_EQ(sums[1], 3000);
  EXPECT_LT(PeakRssMiB() - rss_before, 512) << "the store allocated from a stranger's length prefix";
}

TEST(StoreTest, ListensOnlyOnTheGivenAddress) {
  // Another local address of this machine, if it has one besides loopback.
  std::string other;
  try {
    other = LocalAddressToward("192.0.2.1");  // TEST-NET-1: only the route is looked up
  } catch (const InvalidArgumentError&) {
  }
  const int port = FreePort();
  auto store = CreateStore([&] {
    auto o = Tcp(0, port);
    o.world_size = 1;
    return o;
  }());
  const int fd = Connect("127.0.0.1", port);
  EXPECT_GE(fd, 0) << "the store does not listen on its address 127.0.0.1";
  if (fd >= 0) close(fd);
  if (other.empty() || other.rfind("127.", 0) == 0) {
    ST_SKIP_UNLESS_CI() << "no non-loopback address on this machine";
  }
  const int outside = Connect(other, port);
  EXPECT_LT(outside, 0) << "a store for 127.0.0.1 accepts connections on " << other;
  if (outside >= 0) close(outside);
}

TEST(StoreTest, BindAddressThatIsNotLocalIsRefusedWithItsName) {
  auto o = Tcp(0, FreePort());
  o.world_size = 1;
  o.bind_address = "198.51.100.1";  // TEST-NET-2, not an address of this machine
  try {
    CreateStore(o);
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on '198.51.100.1'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'*' for every interface"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardtrain::comm
