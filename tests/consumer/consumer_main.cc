// The consumer workspace's only source (copied there by consumer_test.sh): a
// program outside ShardTrain that links @shardtrain//:comm, :gloo and
// :rendezvous and nothing else of ShardTrain. It creates a HashStore, a 1-rank
// GlooCommunicator, runs one all-gather and prints the result.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <iostream>

#include "comm/gloo_communicator.h"
#include "comm/rendezvous.h"

int main() {
  using namespace shardtrain::comm;
  auto store = CreateHashStore();
  GlooOptions options;
  options.hostname = "127.0.0.1";
  auto comm = GlooCommunicator::Create(store, /*rank=*/0, /*size=*/1, options);

  at::Tensor input = at::arange(1, 4, at::kFloat);  // [1, 2, 3]
  at::Tensor output = at::empty({3}, at::kFloat);
  comm->AllGather(input, output)->Wait();

  std::cout << "consumer: " << comm->backend() << " all_gather over " << comm->size() << " rank ->";
  for (int64_t i = 0; i < output.numel(); ++i) std::cout << " " << output[i].item<float>();
  std::cout << std::endl;
  return output.equal(input) ? 0 : 1;
}
