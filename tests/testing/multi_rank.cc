#include "tests/testing/multi_rank.h"

#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "base/logging.h"
#include "comm/rendezvous.h"

namespace shardtrain::testing {

void RunRanksWithOptions(int world_size, const std::function<comm::GlooOptions(int rank)>& options,
                         const OwningRankBody& body) {
  // Ranks are threads on a 2-core machine: one intra-op thread each, or
  // OpenMP pools oversubscribe the cores and Gloo's I/O threads starve.
  at::set_num_threads(1);
  auto store = comm::CreateHashStore();
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      SetThreadLogRank(r, world_size);
      try {
        comm::GlooOptions o = options(r);
        if (o.hostname.empty()) o.hostname = "127.0.0.1";
        body(r, comm::GlooCommunicator::Create(store, r, world_size, o));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

void RunRanks(int world_size, const RankBody& body, std::chrono::milliseconds timeout) {
  RunRanksWithOptions(
      world_size,
      [timeout](int) {
        comm::GlooOptions o;
        o.timeout = timeout;
        return o;
      },
      [&body](int rank, std::shared_ptr<comm::GlooCommunicator> comm) { body(rank, comm); });
}

}  // namespace shardtrain::testing
