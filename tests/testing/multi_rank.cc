#include "tests/testing/multi_rank.h"

#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "comm/logging.h"
#include "comm/rendezvous.h"

namespace shardtrain::testing {

void RunRanks(int world_size, const RankBody& body, std::chrono::milliseconds timeout) {
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
        comm::GlooOptions o;
        o.hostname = "127.0.0.1";
        o.timeout = timeout;
        auto c = comm::GlooCommunicator::Create(store, r, world_size, o);
        body(r, c);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace shardtrain::testing
