// The model_parallel strategy (tensor parallel x FSDP) against single-device
// training of the same model: W=4 threads over real Gloo, meshes 2x2, 1x4 and
// 4x1, with and without sequence parallelism, AdamW with gradient clipping.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <mutex>

#include "base/errors.h"
#include "strategies/model_parallel/model_parallel_strategy.h"
#include "strategies/registry.h"
#include "tests/tensor_parallel/tiny_tp_lm.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::strategies {
namespace {

using tensor_parallel::testing::TinyConfig;
using tensor_parallel::testing::TinyLmImpl;

constexpr int kSteps = 3;
constexpr int kGlobalBatch = 4;
constexpr double kMaxNorm = 0.5;  // small enough that every step clips

std::shared_ptr<TinyLmImpl> Build(const TinyConfig& c) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  at::manual_seed(11);
  return std::make_shared<TinyLmImpl>(c);
}

struct Batch {
  at::Tensor ids, targets;
};

Batch GlobalBatch(const TinyConfig& c, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return {at::randint(c.vocab, {kGlobalBatch, c.block}, gen), at::randint(c.vocab, {kGlobalBatch, c.block}, gen)};
}

// eps 1e-5, not 1e-8: the key bias's gradient is zero up to rounding (softmax
// ignores a shift of every key), and Adam turns rounding noise of 1e-9 into
// steps of +-lr with a tiny eps, in any two runs that sum in another order.
torch::optim::AdamWOptions Adam() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-5); }

struct TrainingRun {
  std::vector<double> losses, norms;
  std::map<std::string, at::Tensor> weights;
};

TrainingRun SingleDevice(const TinyConfig& c) {
  auto model = Build(c);
  torch::optim::AdamW opt(model->parameters(), Adam());
  TrainingRun run;
  for (int step = 0; step < kSteps; ++step) {
    const Batch b = GlobalBatch(c, step);
    opt.zero_grad();
    at::Tensor loss = model->Loss(model->forward(b.ids), b.targets);
    loss.backward();
    run.losses.push_back(loss.item<double>());
    run.norms.push_back(ClipLocalGradNorm(model->parameters(), kMaxNorm, 2.0).item<double>());
    opt.step();
  }
  for (const auto& p : model->named_parameters()) run.weights[p.key()] = p.value().detach().clone();
  return run;
}

// Sets `s` up on `world` and builds TinyLm in its construction scope, wrapped.
std::shared_ptr<TinyLmImpl> SetUpAndWrap(Strategy& s, const std::shared_ptr<comm::GlooCommunicator>& world,
                                         const TinyConfig& c) {
  s.Setup(world, ClusterInfo{});
  std::shared_ptr<TinyLmImpl> model;
  {
    auto scope = s.MakeConstructionScope();
    model = Build(c);
  }
  s.WrapModel(model);
  return model;
}

class ModelParallelParity : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ModelParallelParity, TrainingEqualsSingleDevice) {
  const auto [dp, sequence_parallel] = GetParam();
  const int tp = 4 / dp;
  TinyConfig c;
  c.vocab = 40;  // even over 2 and 4 ranks (sequence parallel needs it)
  const TrainingRun want = SingleDevice(c);
  shardtrain::testing::RunRanks(4, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
    ModelParallelOptions o;
    o.data_parallel_size = dp;
    o.tensor_parallel_size = tp;
    o.sequence_parallel = sequence_parallel;
    ModelParallelStrategy s(o);
    const auto model = SetUpAndWrap(s, world, c);
    torch::optim::AdamW opt(s.parameters(), Adam());
    const int per_rank = kGlobalBatch / dp;
    for (int step = 0; step < kSteps; ++step) {
      const Batch b = GlobalBatch(c, step);
      const int64_t first = s.mesh().dp_rank * per_rank;
      opt.zero_grad();
      at::Tensor logits = s.Forward([&] { return model->forward(b.ids.slice(0, first, first + per_rank)); });
      at::Tensor loss = model->Loss(logits, b.targets.slice(0, first, first + per_rank));
      s.Backward(loss);
      const double norm = s.ClipGradients(kMaxNorm, GradClipAlgorithm::kNorm);
      opt.step();
      EXPECT_NEAR(s.ReduceMean(loss.item<double>()), want.losses[step], 1e-5 * want.losses[step]) << "step " << step;
      EXPECT_NEAR(norm, want.norms[step], 1e-5 * want.norms[step]) << "step " << step;
    }
    const auto state = s.FullStateDict();
    if (rank != 0) return;
    ASSERT_EQ(state.size(), want.weights.size());
    for (const auto& [name, w] : want.weights) {
      ASSERT_EQ(state.at(name).sizes(), w.sizes()) << name;
      EXPECT_LE((state.at(name) - w).abs().max().item<double>(), 1e-5 * std::max(1.0, w.abs().max().item<double>()))
          << name;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, ModelParallelParity, ::testing::Combine(::testing::Values(2, 1, 4), ::testing::Bool()),
                         [](const auto& info) {
                           const int dp = std::get<0>(info.param);
                           return std::to_string(dp) + "x" + std::to_string(4 / dp) +
                                  (std::get<1>(info.param) ? "_sequence_parallel" : "");
                         });

// Activation checkpointing of the blocks at 2x2 with sequence parallelism:
// the blocks' forwards (and their tensor-parallel collectives) run again in
// backward, and training still equals single-device training.
TEST(ModelParallelStrategyTest, ActivationCheckpointingRecomputesTheBlocksAndKeepsParity) {
  TinyConfig c;
  c.vocab = 40;
  const TrainingRun want = SingleDevice(c);
  tensor_parallel::testing::TinyBlockImpl::forward_calls = 0;
  shardtrain::testing::RunRanks(4, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
    auto s = StrategyRegistry::Create(
        "model_parallel",
        {{"tensor_parallel_size", "2"}, {"sequence_parallel", "true"}, {"activation_checkpointing", "TinyBlockImpl"}});
    const auto model = SetUpAndWrap(*s, world, c);
    torch::optim::AdamW opt(s->parameters(), Adam());
    const int64_t first = dynamic_cast<ModelParallelStrategy&>(*s).mesh().dp_rank * 2;
    for (int step = 0; step < kSteps; ++step) {
      const Batch b = GlobalBatch(c, step);
      opt.zero_grad();
      at::Tensor logits = s->Forward([&] { return model->forward(b.ids.slice(0, first, first + 2)); });
      at::Tensor loss = model->Loss(logits, b.targets.slice(0, first, first + 2));
      s->Backward(loss);
      s->ClipGradients(kMaxNorm, GradClipAlgorithm::kNorm);
      opt.step();
      EXPECT_NEAR(s->ReduceMean(loss.item<double>()), want.losses[step], 1e-5 * want.losses[step]) << step;
    }
    const auto state = s->FullStateDict();
    if (rank != 0) return;
    for (const auto& [name, w] : want.weights) {
      EXPECT_LE((state.at(name) - w).abs().max().item<double>(), 1e-5 * std::max(1.0, w.abs().max().item<double>()))
          << name;
    }
  });
  // 4 ranks x 2 blocks x 3 steps, each forward run twice (once more in backward).
  EXPECT_EQ(tensor_parallel::testing::TinyBlockImpl::forward_calls.load(), 4 * 2 * kSteps * 2);
}

// bf16-mixed: the model computes in bfloat16 (the logits are bf16) from
// float32 master weights, and its losses stay near the float32 run's.
TEST(ModelParallelStrategyTest, MixedPrecisionComputesInBfloat16) {
  TinyConfig c;
  c.vocab = 40;
  const TrainingRun want = SingleDevice(c);
  shardtrain::testing::RunRanks(4, [&](int, const std::shared_ptr<comm::GlooCommunicator>& world) {
    auto s = StrategyRegistry::Create("model_parallel", {{"tensor_parallel_size", "2"}});
    s->SetPrecision("bf16-mixed");
    const auto model = SetUpAndWrap(*s, world, c);
    for (const auto& p : s->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    const int64_t first = dynamic_cast<ModelParallelStrategy&>(*s).mesh().dp_rank * 2;
    const Batch b = GlobalBatch(c, 0);
    at::Tensor logits = s->Forward([&] { return model->forward(b.ids.slice(0, first, first + 2)); });
    EXPECT_EQ(logits.scalar_type(), at::kBFloat16);
    at::Tensor loss = model->Loss(logits, b.targets.slice(0, first, first + 2));
    s->Backward(loss);
    EXPECT_NEAR(s->ReduceMean(loss.item<double>()), want.losses[0], 0.05 * want.losses[0]);
  });
}

// What one forward and backward of TinyLm send over the tensor-parallel
// group, per rank, from its shapes: B sequences of T tokens of width C on this
// rank, L blocks, a group of w. Without sequence parallelism: all-reduces of
// [B, T, C] after the embedding and each row-wise layer (forward) and before
// the head and each column-wise layer (backward), and 3 of [B*T] in the
// cross-entropy. With it: those become all-gathers and reduce-scatters of the
// sequence shards, and the partial gradients (5 norms' weight and bias, wpe,
// the row-wise biases) are all-reduced.
comm::CommStats TheoryPerStep(const TinyConfig& c, int64_t B, int w, bool sp) {
  const int64_t T = c.block, C = c.embd, L = c.layers, A = B * T * C, N = B * T, f = sizeof(float);
  const auto all_reduce = [&](int64_t floats) { return 2 * (w - 1) * floats * f / w; };
  comm::CommStats s;
  auto& calls = s.calls;
  auto& bytes = s.bytes_sent;
  const int ar = static_cast<int>(comm::CommOp::kAllReduce), ag = static_cast<int>(comm::CommOp::kAllGather),
            rs = static_cast<int>(comm::CommOp::kReduceScatter);
  if (!sp) {
    calls[ar] = 5 + 4 * L;
    bytes[ar] = (2 + 4 * L) * all_reduce(A) + 3 * all_reduce(N);
    return s;
  }
  calls[ag] = calls[rs] = 4 * L + 2;
  bytes[ag] = bytes[rs] = (4 * L + 2) * (w - 1) * (A / w) * f;
  const int64_t partial = 5 * 2 * C + c.block * C + 2 * L * C;  // norms, wpe, row-wise biases
  calls[ar] = 3 + 5 * 2 + 1 + 2 * L;
  bytes[ar] = 3 * all_reduce(N) + all_reduce(partial);
  return s;
}

// Bytes per mesh dimension: the tensor-parallel group's accounting of one
// step equals the theory above (2x2 without, 1x4 with sequence parallelism).
TEST(ModelParallelStrategyTest, TensorParallelBytesEqualTheory) {
  TinyConfig c;
  c.vocab = 40;
  for (const auto& [dp, sp] : std::vector<std::pair<int, bool>>{{2, false}, {1, true}}) {
    shardtrain::testing::RunRanks(4, [&, dp = dp, sp = sp](int, const std::shared_ptr<comm::GlooCommunicator>& world) {
      ModelParallelOptions o;
      o.data_parallel_size = dp;
      o.sequence_parallel = sp;
      ModelParallelStrategy s(o);
      const auto model = SetUpAndWrap(s, world, c);
      const int64_t B = kGlobalBatch / dp, first = s.mesh().dp_rank * B;
      const Batch b = GlobalBatch(c, 0);
      s.mesh().tp->ResetStats();
      at::Tensor logits = s.Forward([&] { return model->forward(b.ids.slice(0, first, first + B)); });
      s.Backward(model->Loss(logits, b.targets.slice(0, first, first + B)));
      const comm::CommStats got = s.mesh().tp->stats();
      const comm::CommStats want = TheoryPerStep(c, B, 4 / dp, sp);
      for (const auto op : {comm::CommOp::kAllReduce, comm::CommOp::kAllGather, comm::CommOp::kReduceScatter}) {
        EXPECT_EQ(got.Calls(op), want.Calls(op)) << comm::CommOpName(op) << (sp ? " sequence parallel" : "");
        EXPECT_EQ(got.BytesSent(op), want.BytesSent(op)) << comm::CommOpName(op) << (sp ? " sequence parallel" : "");
      }
    });
  }
}

// The data-parallel dimension and memory per rank, from the model's shapes:
// each FSDP unit holds this rank's tensor-parallel pieces (Placement::
// LocalShape; replicated parameters whole), padded to a multiple of the
// data-parallel size; a rank stores 1/dp of that (its share of the model), and
// one forward and backward sends over the data-parallel group the all-gathers
// of the blocks twice (forward, and backward after the reshard) and the root
// once, and one reduce-scatter of every unit: (dp - 1) / dp of the padded
// float32 bytes each.
TEST(ModelParallelStrategyTest, DataParallelBytesAndMemoryPerRankEqualTheory) {
  TinyConfig c;
  c.vocab = 37;  // uneven over the tensor-parallel group
  for (const int dp : {2, 4, 1}) {
    shardtrain::testing::RunRanks(4, [&](int, const std::shared_ptr<comm::GlooCommunicator>& world) {
      ModelParallelOptions o;
      o.data_parallel_size = dp;
      ModelParallelStrategy s(o);
      const auto model = SetUpAndWrap(s, world, c);
      const int tp = 4 / dp;
      int64_t gathered = 0, reduced = 0, stored = 0, share_numerator = 0;
      double uneven = 0;  // how far torch.chunk's split puts this rank's pieces from 1/tp of each
      const sharding::ShardedStateDict sd = s.ShardedState();
      for (size_t u = 0; u < sd.units.size(); ++u) {
        int64_t local = 0;
        for (const std::string& name : sd.units[u].param_names) {
          const auto it = s.placements().find(name);
          ASSERT_NE(it, s.placements().end()) << name;
          const tensor_parallel::Placement& p = it->second;
          const int64_t global = c10::multiply_integers(p.global_shape);
          const int64_t mine = p.sharded ? c10::multiply_integers(p.LocalShape(s.mesh().tp_rank, tp)) : global;
          local += mine;
          share_numerator += p.sharded ? global : global * tp;
          if (p.sharded) uneven += std::abs(static_cast<double>(mine) - static_cast<double>(global) / tp) / dp;
        }
        const int64_t padded = (local + dp - 1) / dp * dp;
        stored += padded / dp;
        reduced += padded;
        gathered += padded * (sd.units[u].name.empty() ? 1 : 2);
        EXPECT_EQ(sd.shards[u].numel(), padded / dp) << "unit '" << sd.units[u].name << "'";
      }
      // The model's share, but for the padding (under one element per unit)
      // and the uneven splits (the vocabulary of 37).
      EXPECT_NEAR(static_cast<double>(stored), static_cast<double>(share_numerator) / (dp * tp),
                  static_cast<double>(sd.units.size()) + uneven)
          << dp << "x" << tp;
      const int64_t B = kGlobalBatch / dp, first = s.mesh().dp_rank * B;
      const Batch b = GlobalBatch(c, 0);
      s.mesh().dp->ResetStats();
      at::Tensor logits = s.Forward([&] { return model->forward(b.ids.slice(0, first, first + B)); });
      s.Backward(model->Loss(logits, b.targets.slice(0, first, first + B)));
      const comm::CommStats got = s.mesh().dp->stats();
      const int64_t f = sizeof(float);
      EXPECT_EQ(got.BytesSent(comm::CommOp::kAllGather), gathered * f * (dp - 1) / dp) << dp << "x" << tp;
      EXPECT_EQ(got.BytesSent(comm::CommOp::kReduceScatter), reduced * f * (dp - 1) / dp) << dp << "x" << tp;
      EXPECT_EQ(got.BytesSent(comm::CommOp::kAllReduce), 0) << dp << "x" << tp;
    });
  }
}

TEST(ModelParallelStrategyTest, FullStateDictLoadsBackAtGlobalShapes) {
  TinyConfig c;
  shardtrain::testing::RunRanks(4, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
    auto s = StrategyRegistry::Create("model_parallel", {{"tensor_parallel_size", "2"}});
    const auto model = SetUpAndWrap(*s, world, c);
    std::map<std::string, at::Tensor> state = s->FullStateDict();
    // Every rank loads the same global state (rank 0's, broadcast in name order).
    std::map<std::string, at::Tensor> global;
    for (const auto& [name, p] : dynamic_cast<ModelParallelStrategy&>(*s).placements()) {
      at::Tensor t = rank == 0 ? state.at(name) : at::empty(p.global_shape);
      world->Broadcast(t, 0)->Wait();
      global[name] = t.mul(2);
    }
    s->LoadFullStateDict(global);
    const auto again = s->FullStateDict();
    if (rank == 0) {
      for (const auto& [name, t] : global) EXPECT_TRUE(at::equal(again.at(name), t)) << name;
    }
  });
}

TEST(ModelParallelStrategyTest, AModelBuiltOutsideTheScopeIsRefused) {
  shardtrain::testing::RunRanks(2, [&](int, const std::shared_ptr<comm::GlooCommunicator>& world) {
    ModelParallelOptions o;
    o.tensor_parallel_size = 2;
    ModelParallelStrategy s(o);
    s.Setup(world, ClusterInfo{});
    try {
      s.WrapModel(Build(TinyConfig()));
      ADD_FAILURE() << "a model without tensor-parallel parameters accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("while the strategy's MakeConstructionScope() is held"), std::string::npos)
          << e.what();
    }
  });
}

TEST(ModelParallelStrategyTest, SequenceParallelNeedsEvenSplits) {
  shardtrain::testing::RunRanks(2, [&](int, const std::shared_ptr<comm::GlooCommunicator>& world) {
    ModelParallelOptions o;
    o.tensor_parallel_size = 2;
    o.sequence_parallel = true;
    ModelParallelStrategy s(o);
    s.Setup(world, ClusterInfo{});
    std::shared_ptr<TinyLmImpl> model;
    {
      auto scope = s.MakeConstructionScope();
      model = Build(TinyConfig());  // vocabulary 37
    }
    try {
      s.WrapModel(model);
      ADD_FAILURE() << "an uneven vocabulary under sequence parallelism accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("wte.weight"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace shardtrain::strategies
