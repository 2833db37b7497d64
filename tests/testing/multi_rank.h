// Threads-as-ranks: runs `body(rank, communicator)` on W threads that share a
// c10d HashStore and talk real Gloo over 127.0.0.1. The first exception from
// any rank is rethrown on the calling thread after all threads ended.
#ifndef SHARDTRAIN_TESTS_TESTING_MULTI_RANK_H_
#define SHARDTRAIN_TESTS_TESTING_MULTI_RANK_H_

#include <chrono>
#include <functional>
#include <memory>

#include "comm/gloo_communicator.h"

namespace shardtrain::testing {

using RankBody = std::function<void(int rank, const std::shared_ptr<comm::GlooCommunicator>& comm)>;

void RunRanks(int world_size, const RankBody& body,
              std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Like RunRanks, with rank r's communicator made from options(r) (on
// 127.0.0.1 unless it names a host), and handed to the body as the only
// reference to it: resetting it destroys the communicator.
using OwningRankBody = std::function<void(int rank, std::shared_ptr<comm::GlooCommunicator> comm)>;
void RunRanksWithOptions(int world_size, const std::function<comm::GlooOptions(int rank)>& options,
                         const OwningRankBody& body);

}  // namespace shardtrain::testing

#endif  // SHARDTRAIN_TESTS_TESTING_MULTI_RANK_H_
