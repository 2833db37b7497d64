// Trains the tiny test GPT with ShardedModel (FULL_SHARD, 2 threads-as-ranks,
// SGD) and writes what Python PyTorch needs to train the same model itself:
// <out>/oracle.pt: initial weights (state dict names), the batches of every
// step, and the global loss ShardTrain computed at each step.
#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/sgd.h>

#include <fstream>
#include <iostream>
#include <mutex>

#include "sharding/sharded_model.h"
#include "tests/testing/models.h"
#include "tests/testing/multi_rank.h"

int main(int argc, char** argv) {
  using namespace shardtrain;
  if (argc != 3) {
    std::cerr << "usage: gpt_oracle_dump OUT_FILE STEPS\n";
    return 2;
  }
  const int steps = std::stoi(argv[2]);
  const int64_t batch = 8;
  auto tm = testing::TinyGpt();
  c10::Dict<std::string, at::Tensor> out;
  {
    auto m = tm.make();
    for (const auto& p : m->named_parameters()) out.insert("init." + p.key(), p.value().detach().clone());
  }
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = tm.data(s, batch);
    out.insert("x." + std::to_string(s), x.contiguous());
    out.insert("y." + std::to_string(s), y.contiguous());
  }
  std::vector<std::shared_ptr<torch::nn::Module>> models{tm.make(), tm.make()};
  std::vector<double> losses;
  std::mutex mu;
  testing::RunRanks(2, [&](int rank, const auto& comm) {
    sharding::ShardedModel sm(models[rank], comm, {});
    torch::optim::SGD opt(sm.parameters(), torch::optim::SGDOptions(0.1));
    std::vector<double> mine;
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = tm.data(s, batch);
      x = x.slice(0, rank * batch / 2, (rank + 1) * batch / 2);
      y = y.slice(0, rank * batch / 2, (rank + 1) * batch / 2);
      opt.zero_grad();
      at::Tensor loss = tm.loss(sm.Forward([&] { return tm.forward(sm.module(), x); }), y);
      loss.backward();
      opt.step();
      at::Tensor l = loss.detach().reshape({1}).clone();
      comm->AllReduce(l, {comm::ReduceOp::kAvg})->Wait();
      mine.push_back(l.item<double>());
    }
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) losses = mine;
  });
  out.insert("losses", at::tensor(losses, at::kDouble));
  auto bytes = torch::jit::pickle_save(out);
  std::ofstream(argv[1], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return 0;
}
