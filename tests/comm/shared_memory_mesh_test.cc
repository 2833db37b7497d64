// SharedMemoryMesh on its own (ranks as threads over a HashStore): when a peer
// that left is a failure. Linked into gloo_communicator_test.
#include "comm/gloo/shared_memory_mesh.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/rendezvous.h"

namespace shardtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int64_t kRing = 64 << 10;

MeshRendezvous OverStore(const c10::intrusive_ptr<c10d::Store>& store) {
  MeshRendezvous r;
  r.set = [store](const std::string& k, const std::string& v) {
    store->set(k, std::vector<uint8_t>(v.begin(), v.end()));
  };
  r.get = [store](const std::string& k) {
    const std::vector<uint8_t> v = store->get(k);
    return std::string(v.begin(), v.end());
  };
  r.add = [store](const std::string& k, int64_t delta) { return store->add(k, delta); };
  return r;
}

// Runs body(rank, mesh) on `world` threads, each with its own mesh (the body
// may destroy it); rethrows the first exception.
void RunMesh(int world, const std::function<void(int, std::unique_ptr<SharedMemoryMesh>)>& body) {
  const MeshRendezvous store = OverStore(CreateHashStore());
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::string why;
        auto mesh = SharedMemoryMesh::Connect(store, r, world, true, kRing, &why);
        if (!mesh) throw std::runtime_error("no mesh: " + why);
        body(r, std::move(mesh));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// Sends `out` to every peer and receives `recv` bytes from each.
std::vector<SharedMemoryMesh::PeerTraffic> Traffic(int world, const std::vector<uint8_t>& out, int64_t recv) {
  std::vector<SharedMemoryMesh::PeerTraffic> t(world);
  for (auto& p : t) p = {{{out.data(), static_cast<int64_t>(out.size())}}, recv};
  return t;
}

// A consumer may hold a peer's bytes back (OrderedSum waits for the ranks
// before it). A peer that wrote everything and closed its mesh meanwhile, as
// at the end of a job, is no failure: its bytes are in the ring.
TEST(SharedMemoryMesh, PeerThatLeftAfterWritingAllIsNoFailureWhileItsBytesWait) {
  std::atomic<bool> rank0_gone{false};
  std::atomic<Clock::rep> gone_at{0};
  std::vector<uint8_t> got(4096);
  RunMesh(2, [&](int rank, std::unique_ptr<SharedMemoryMesh> mesh) {
    const std::vector<uint8_t> mine(got.size(), static_cast<uint8_t>(rank + 1));
    const auto deadline = Clock::now() + 20s;
    if (rank == 0) {
      std::vector<uint8_t> in(got.size());
      mesh->Exchange(Traffic(2, mine, in.size()),
                     [&](int, int64_t off, const uint8_t* d, int64_t n) {
                       std::memcpy(in.data() + off, d, n);
                       return n;
                     },
                     deadline);
      mesh.reset();  // closes at once, as a communicator destroyed after its last collective
      gone_at = Clock::now().time_since_epoch().count();
      rank0_gone = true;
      return;
    }
    // Rank 1 takes rank 0's bytes only 100 ms after rank 0 left.
    mesh->Exchange(Traffic(2, mine, got.size()),
                   [&](int, int64_t off, const uint8_t* d, int64_t n) -> int64_t {
                     const auto wait_until = Clock::time_point(Clock::duration(gone_at.load())) + 100ms;
                     if (!rank0_gone || Clock::now() < wait_until) return 0;
                     std::memcpy(got.data() + off, d, n);
                     return n;
                   },
                   deadline);
  });
  EXPECT_EQ(got, std::vector<uint8_t>(got.size(), 1));
}

// A peer that left before writing all this rank needs is a failure naming it,
// and so is one that left without reading what this rank still has to write
// (more than the ring holds); both fail at once, not at the deadline.
TEST(SharedMemoryMesh, PeerThatLeftOwingBytesIsAFailure) {
  for (const bool owes_to_rank1 : {true, false}) {
    RunMesh(2, [&](int rank, std::unique_ptr<SharedMemoryMesh> mesh) {
      auto keep = [](int, int64_t, const uint8_t*, int64_t n) { return n; };
      const auto deadline = Clock::now() + 20s;
      if (rank == 0) {
        // Sends 8 of the 16 bytes rank 1 wants, or reads none of rank 1's 4 rings' worth.
        const std::vector<uint8_t> mine(8, 7);
        mesh->Exchange(Traffic(2, mine, 0), keep, deadline);
        return;  // closes
      }
      const std::vector<uint8_t> mine(owes_to_rank1 ? 0 : 4 * kRing, 9);
      const auto start = Clock::now();
      try {
        mesh->Exchange(Traffic(2, mine, owes_to_rank1 ? 16 : 8), keep, deadline);
        ADD_FAILURE() << "expected SharedMemoryError";
      } catch (const SharedMemoryError& e) {
        EXPECT_EQ(e.kind(), SharedMemoryError::Kind::kPeerClosed) << e.what();
        EXPECT_EQ(e.peer(), 0);
        EXPECT_NE(std::string(e.what()).find("rank 0 left the shared memory mesh"), std::string::npos) << e.what();
        const char* why = owes_to_rank1 ? "having written 8 of the 16 bytes this rank needs" : "would never be read";
        EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      }
      EXPECT_LT(Clock::now() - start, 5s);
    });
  }
}

}  // namespace
}  // namespace shardtrain::comm
