// Signed store values (comm/signed_store.h) over a real c10d TCPStore: ranks that
// share the secret run Gloo collectives through it (shared memory on, so the
// shared-memory token, heartbeats and Gloo's addresses are all signed); a
// stranger client without the secret who writes keys, forges values or moves
// a valid value to another key is refused with an error naming the key; a
// rank given another secret fails at connect, on both sides, within the
// timeout (no hang); the secret file must not be readable by others.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"
#include "comm/signed_store.h"

namespace shardtrain::comm {
namespace {

constexpr const char* kSecret = "0123456789abcdef0123456789abcdef";

// A rank's c10d TCPStore with signed values. (CreateStore with a secret
// gives the authenticated store instead, comm/auth_store.h; signing stays for
// c10d's stores: FileStore, torchrun's agent store.)
c10::intrusive_ptr<c10d::Store> SignedTcp(int rank, int port, const std::string& secret = kSecret) {
  RendezvousOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.timeout = std::chrono::seconds(10);
  return SignStore(CreateStore(o), secret);
}


// A c10d client of the store at `port` that does not know the secret.
c10::intrusive_ptr<c10d::Store> Stranger(int port) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(10);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

void ExpectRefused(const std::function<void()>& read, const std::string& key) {
  try {
    read();
    ADD_FAILURE() << "a value of '" << key << "' without a valid signature was accepted";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("store key '" + key + "'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("was not written by a rank of this job"), std::string::npos) << e.what();
  }
}

int ProbedFreePort() {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  c10d::TCPStore probe("127.0.0.1", o);
  return probe.getPort();
}

TEST(SignedStoreTest, StrangersCannotMakeRanksAcceptTheirValues) {
  const int port = ProbedFreePort();
  auto rank0 = SignedTcp(0, port);
  auto rank1 = SignedTcp(1, port);
  auto stranger = Stranger(port);
  // Signed round trips between the ranks.
  rank0->set("a", Bytes("from rank 0"));
  EXPECT_EQ(rank1->get("a"), Bytes("from rank 0"));
  EXPECT_EQ(rank1->multiGet({"a"}).at(0), Bytes("from rank 0"));
  EXPECT_EQ(rank1->compareSet("a", Bytes("from rank 0"), Bytes("swapped")), Bytes("swapped"));
  EXPECT_EQ(rank0->get("a"), Bytes("swapped"));
  // The stranger's writes: a new key, an overwrite, a short value, and a
  // valid signed value moved to another key.
  stranger->set("forged", Bytes("127.0.0.1:1234"));
  ExpectRefused([&] { rank0->get("forged"); }, "forged");
  stranger->set("a", Bytes("garbage"));
  ExpectRefused([&] { rank1->get("a"); }, "a");
  ExpectRefused([&] { rank1->multiGet({"a"}); }, "a");
  stranger->set("short", std::vector<uint8_t>{});
  ExpectRefused([&] { rank0->get("short"); }, "short");
  rank0->set("b", Bytes("valid for b"));
  stranger->set("c", stranger->get("b"));
  ExpectRefused([&] { rank1->get("c"); }, "c");
  // The stranger reads the values (no confidentiality): the payload, then the 32-byte tag.
  EXPECT_EQ(stranger->get("b").size(), std::string("valid for b").size() + 32);
}

TEST(SignedStoreTest, CollectivesRunOverASignedStore) {
  const int port = ProbedFreePort();
  std::vector<double> sums(2, 0);
  auto body = [&](int rank) {
    GlooOptions go;
    go.timeout = std::chrono::seconds(20);
    auto comm = GlooCommunicator::Create(SignedTcp(rank, port), rank, 2, go);
    at::Tensor t = at::full({1000}, static_cast<float>(rank + 1));
    comm->AllReduce(t)->Wait();
    comm->Barrier()->Wait();
    sums[rank] = t.sum().item<double>();
  };
  std::thread r1(body, 1);
  body(0);
  r1.join();
  EXPECT_EQ(sums[0], 3000);
  EXPECT_EQ(sums[1], 3000);
}

TEST(SignedStoreTest, ARankWithAnotherSecretFailsOnBothSidesNamingAKey) {
  const int port = ProbedFreePort();
  std::vector<std::string> errors(2);
  auto body = [&](int rank) {
    try {
      GlooOptions go;
      go.timeout = std::chrono::seconds(10);
      auto store = SignedTcp(rank, port, rank == 0 ? kSecret : "another secret of 32 bytes......");
      GlooCommunicator::Create(store, rank, 2, go);
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::thread r1(body, 1);
  body(0);
  r1.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(errors[rank].find("was not written by a rank of this job"), std::string::npos)
        << "rank " << rank << ": " << errors[rank];
  }
}

TEST(SignedStoreTest, SecretFromEnvironmentAndFile) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp");
  mkdir(dir.c_str(), 0700);
  const std::string path = dir + "/store_secret";
  std::ofstream(path) << "a secret of at least 16 bytes\n";
  unsetenv(kSecretEnvVar);
  setenv(kSecretFileEnvVar, path.c_str(), 1);
  chmod(path.c_str(), 0644);
  try {
    StoreSecretFromEnvironment();
    ADD_FAILURE() << "a world-readable secret file was accepted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("has mode 0644: group or others may read it; valid: mode 0600"),
              std::string::npos)
        << e.what();
  }
  chmod(path.c_str(), 0600);
  EXPECT_EQ(StoreSecretFromEnvironment(), "a secret of at least 16 bytes");
  setenv(kSecretEnvVar, "short", 1);
  EXPECT_THROW(StoreSecretFromEnvironment(), InvalidArgumentError);
  unsetenv(kSecretEnvVar);
  unsetenv(kSecretFileEnvVar);
  EXPECT_EQ(StoreSecretFromEnvironment(), "");
}

}  // namespace
}  // namespace shardtrain::comm
