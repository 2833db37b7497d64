// Tensor-parallel layers against single-device training of the same model
// (threads as ranks, real Gloo): losses, gathered gradients and placements.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <mutex>

#include "base/errors.h"
#include "tensor_parallel/layers.h"
#include "tensor_parallel/mesh.h"
#include "tensor_parallel/placement.h"
#include "tests/tensor_parallel/tiny_tp_lm.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::tensor_parallel {
namespace {

using testing::TinyConfig;
using testing::TinyLmImpl;

// Builds under the global generator seeded with `seed` (threads take turns).
std::shared_ptr<TinyLmImpl> Build(const TinyConfig& c, uint64_t seed) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  at::manual_seed(seed);
  return std::make_shared<TinyLmImpl>(c);
}

struct Batch {
  at::Tensor ids, targets;
};

Batch MakeBatch(const TinyConfig& c, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Batch b;
  b.ids = at::randint(c.vocab, {3, c.block}, gen);
  b.targets = at::randint(c.vocab, {3, c.block}, gen);
  b.targets.index_put_({0, 1}, -100);  // an ignored target
  return b;
}

void ExpectClose(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  const double scale = std::max(1.0, want.abs().max().item<double>());
  EXPECT_LE(err, 1e-5 * scale) << what << ": max |diff| " << err;
}

struct Reference {
  at::Tensor loss;
  std::map<std::string, at::Tensor> params, grads;
};

Reference RunReference(const TinyConfig& c, const Batch& batch) {
  auto model = Build(c, 7);
  Reference ref;
  ref.loss = model->Loss(model->forward(batch.ids), batch.targets);
  ref.loss.backward();
  for (const auto& p : model->named_parameters()) {
    ref.params[p.key()] = p.value().detach().clone();
    ref.grads[p.key()] = p.value().grad().clone();
  }
  return ref;
}

class TensorParallelParity : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(TensorParallelParity, LossAndGlobalGradientsEqualSingleDevice) {
  const auto [tp, sequence_parallel, bias] = GetParam();
  TinyConfig c;
  c.bias = bias;
  const Batch batch = MakeBatch(c, 3);
  const Reference ref = RunReference(c, batch);
  shardtrain::testing::RunRanks(tp, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
    const DeviceMesh mesh = MakeDeviceMesh(world, 1, tp);
    std::shared_ptr<TinyLmImpl> model;
    {
      TensorParallelScope scope(mesh.tp, sequence_parallel);
      model = Build(c, 7);
    }
    const auto placements = CollectPlacements(*model);
    ASSERT_EQ(placements.size(), ref.params.size());
    for (const auto& p : model->named_parameters()) {
      const Placement& placement = placements.at(p.key());
      EXPECT_EQ(placement.global_shape, ref.params.at(p.key()).sizes().vec()) << p.key();
      ExpectClose(p.value(), LocalPiece(ref.params.at(p.key()), placement, rank, tp), "initial " + p.key());
    }
    at::Tensor loss = model->Loss(model->forward(batch.ids), batch.targets);
    loss.backward();
    ExpectClose(loss.detach(), ref.loss.detach(), "loss");
    for (const auto& p : model->named_parameters()) {
      const Placement& placement = placements.at(p.key());
      at::Tensor grad = p.value().grad().clone();
      if (placement.partial_grad) world->AllReduce(grad)->Wait();
      ExpectClose(GatherGlobal(grad, placement, mesh.tp), ref.grads.at(p.key()), "gradient of " + p.key());
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Plans, TensorParallelParity,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_sequence_parallel" : "") +
                                  (std::get<2>(info.param) ? "_bias" : "_no_bias");
                         });

TEST(TensorParallelPlacement, PlansReportShardedAndPartialParameters) {
  shardtrain::testing::RunRanks(2, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
    TensorParallelScope scope(world, /*sequence_parallel=*/true);
    auto model = Build(TinyConfig(), 1);
    const auto placements = CollectPlacements(*model);
    EXPECT_EQ(placements.at("h0.qkv.weight").ToString(), "Shard(0, chunks=3) of [48, 16]");
    EXPECT_EQ(placements.at("h0.proj.weight").ToString(), "Shard(1) of [16, 16]");
    EXPECT_EQ(placements.at("h0.proj.bias").ToString(), "Replicate [16] (partial gradient)");
    EXPECT_EQ(placements.at("wte.weight").ToString(), "Shard(0) of [37, 16]");
    EXPECT_EQ(placements.at("ln_f.weight").ToString(), "Replicate [16] (partial gradient)");
    EXPECT_EQ(model->named_parameters()["wte.weight"].size(0), rank == 0 ? 19 : 18);
  });
}

TEST(TensorParallelPlacement, PiecesRoundTripThroughGatherGlobal) {
  const at::Tensor global = at::arange(5 * 6 * 3, at::kFloat).reshape({5, 6, 3});
  for (const auto& [dim, chunks] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 1}, {1, 2}, {2, 1}}) {
    Placement p;
    p.sharded = true;
    p.dim = dim;
    p.chunks = chunks;
    p.global_shape = global.sizes().vec();
    shardtrain::testing::RunRanks(3, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
      const at::Tensor piece = LocalPiece(global, p, rank, 3);
      EXPECT_EQ(piece.sizes().vec(), p.LocalShape(rank, 3));
      EXPECT_TRUE(at::equal(GatherGlobal(piece, p, world), global)) << p.ToString();
    });
  }
}

TEST(DeviceMeshTest, GroupsAreConsecutiveForTensorParallelAndStridedForDataParallel) {
  shardtrain::testing::RunRanks(4, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
    const DeviceMesh mesh = MakeDeviceMesh(world, 2, 0);
    EXPECT_EQ(mesh.ToString(), "2x2 (data_parallel x tensor_parallel)");
    at::Tensor tp_sum = at::full({1}, static_cast<float>(rank));
    at::Tensor dp_sum = tp_sum.clone();
    mesh.tp->AllReduce(tp_sum)->Wait();
    mesh.dp->AllReduce(dp_sum)->Wait();
    EXPECT_EQ(tp_sum.item<float>(), rank < 2 ? 1 : 5);       // {0,1}, {2,3}
    EXPECT_EQ(dp_sum.item<float>(), rank % 2 == 0 ? 2 : 4);  // {0,2}, {1,3}
    EXPECT_EQ(mesh.tp_rank, rank % 2);
    EXPECT_EQ(mesh.dp_rank, rank / 2);
    const DeviceMesh flat = MakeDeviceMesh(world, 4, 1);
    EXPECT_EQ(flat.tp->size(), 1);
    EXPECT_EQ(flat.dp->size(), 4);
  });
}

TEST(DeviceMeshTest, BadSizesNameTheValidMeshes) {
  shardtrain::testing::RunRanks(4, [&](int, const std::shared_ptr<comm::GlooCommunicator>& world) {
    try {
      MakeDeviceMesh(world, 3, 2);
      ADD_FAILURE() << "3x2 on 4 ranks accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("valid meshes (data_parallel x tensor_parallel): 1x4, 2x2, 4x1"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(MakeDeviceMesh(world, 0, 3), InvalidArgumentError);
  });
}

TEST(TensorParallelLayers, TooSmallDimensionsAreRefusedNamingTheSplit) {
  shardtrain::testing::RunRanks(4, [&](int, const std::shared_ptr<comm::GlooCommunicator>& world) {
    TensorParallelScope scope(world, false);
    try {
      ParallelEmbeddingImpl embedding(5, 4);  // torch.chunk: 2, 2, 1, 0 rows
      ADD_FAILURE() << "an embedding of 5 rows over 4 ranks accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("5 rows cannot be split over a tensor-parallel group of 4"),
                std::string::npos)
          << e.what();
    }
    ParallelLinearOptions fused(8, 3 * 8, LinearStyle::kColwise);
    fused.chunks = 5;
    EXPECT_THROW(ParallelLinearImpl{fused}, InvalidArgumentError);
  });
}

}  // namespace
}  // namespace shardtrain::tensor_parallel
