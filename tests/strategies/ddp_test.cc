// ddp specifics: all-reduces overlapped with backward, parameters without a
// gradient, find_unused_parameters, gradients set to none; clip-by-value.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/strategies/strategy_fixture.h"

namespace shardtrain::strategies {
namespace {

TEST(Ddp, OverlapsAllReducesWithBackwardAndAverages) {
  auto tm = shardtrain::testing::MlpWithBatchNorm();
  std::vector<std::shared_ptr<torch::nn::Module>> models, alone;
  for (int r = 0; r < 2; ++r) {
    models.push_back(tm.make());
    alone.push_back(tm.make());
  }
  // Each rank's own gradients, computed without any strategy.
  auto [x, y] = tm.data(0, 8);
  std::vector<std::map<std::string, at::Tensor>> local(2);
  for (int r = 0; r < 2; ++r) {
    alone[r]->train();
    tm.loss(tm.forward(*alone[r], x.slice(0, r * 4, r * 4 + 4)), y.slice(0, r * 4, r * 4 + 4)).backward();
    for (const auto& p : alone[r]->named_parameters()) local[r][p.key()] = p.value().grad().clone();
  }
  RunRanks(2, [&](int rank, const auto& comm) {
    DdpOptions o;
    o.bucket_cap_mb = 0.001;  // about one parameter per bucket
    DdpStrategy s(o);
    s.Setup(comm, {});
    s.WrapModel(models[rank]);
    s.module().train();
    EXPECT_GT(s.num_buckets(), 2);
    const at::Tensor xr = x.slice(0, rank * 4, rank * 4 + 4), yr = y.slice(0, rank * 4, rank * 4 + 4);
    const int64_t before = comm->stats().Calls(comm::CommOp::kAllReduce);
    // Accumulate one micro-batch without sync, then the same again with sync:
    // the result is twice the average.
    s.Backward(tm.loss(s.Forward([&] { return tm.forward(s.module(), xr); }), yr), /*sync_gradients=*/false);
    EXPECT_EQ(comm->stats().Calls(comm::CommOp::kAllReduce), before);
    s.Backward(tm.loss(s.Forward([&] { return tm.forward(s.module(), xr); }), yr));
    EXPECT_EQ(comm->stats().Calls(comm::CommOp::kAllReduce) - before, s.num_buckets());
    EXPECT_EQ(s.last_launched_during_backward(), s.num_buckets());  // every parameter got a gradient in backward
    for (const auto& [name, p] : s.named_parameters()) {
      const at::Tensor want = local[0].at(name) + local[1].at(name);  // 2 micro-batches x mean of 2 ranks
      EXPECT_TRUE(at::allclose(p.grad(), want, 1e-5, 1e-6)) << name;
    }
  });
}

TEST(Ddp, ParameterWithoutGradientStillSynchronizes) {
  RunRanks(2, [](int rank, const auto& comm) {
    at::manual_seed(3);
    auto net = std::make_shared<torch::nn::Module>();
    at::Tensor used = net->register_parameter("used", at::ones({4}));
    at::Tensor unused = net->register_parameter("unused", at::ones({4}));
    DdpOptions o;
    o.bucket_cap_mb = 1e-5;  // one parameter per bucket
    o.find_unused_parameters = true;
    DdpStrategy s(o);
    s.Setup(comm, {});
    s.WrapModel(net);
    ASSERT_EQ(s.num_buckets(), 2);
    // Bucket 0 holds "unused" (reverse order): it launches when backward
    // ends, and "used"'s bucket (complete earlier) waits for it to keep the
    // collective order.
    s.Backward((used * static_cast<double>(rank + 1)).sum());
    EXPECT_EQ(s.last_launched_during_backward(), 0);
    EXPECT_TRUE(at::equal(used.grad(), at::full({4}, 1.5)));
    EXPECT_TRUE(at::equal(unused.grad(), at::zeros({4})));
  });
}

// find_unused_parameters=false (the default, as PyTorch DDP): a trainable
// parameter without a gradient in a syncing backward is an error naming it
// and the option, on every rank and at W=1, after the buckets are reduced
// (no rank is left waiting in a collective); accumulating without sync is not
// checked, and the next syncing backward that uses everything passes.
TEST(Ddp, ParameterWithoutGradientIsAnErrorUnlessFindUnusedParameters) {
  for (int world : {1, 2}) {
    RunRanks(world, [world](int rank, const auto& comm) {
      auto net = std::make_shared<torch::nn::Module>();
      at::Tensor used = net->register_parameter("used", at::ones({4}));
      at::Tensor unused = net->register_parameter("unused", at::ones({4}));
      net->register_parameter("frozen", at::ones({4}), /*requires_grad=*/false);
      DdpOptions o;
      o.bucket_cap_mb = 1e-5;
      DdpStrategy s(o);
      s.Setup(comm, {});
      s.WrapModel(net);
      s.Backward((used * static_cast<double>(rank + 1)).sum(), /*sync_gradients=*/false);
      const std::string msg = ErrorOf([&] { s.Backward((used * static_cast<double>(rank + 1)).sum()); });
      EXPECT_NE(msg.find("got no gradient in this backward: unused."), std::string::npos) << "W=" << world << ": " << msg;
      EXPECT_NE(msg.find("find_unused_parameters=true"), std::string::npos) << msg;
      const double want = world == 1 ? 2.0 : 3.0;  // two backwards of the mean gradient over ranks
      EXPECT_TRUE(at::equal(used.grad(), at::full({4}, want))) << "W=" << world << ": " << used.grad();
      for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
      s.Backward((used + unused).sum());
      EXPECT_TRUE(at::equal(unused.grad(), at::ones({4})));
    });
  }
}

// Gradients set to none (zero_grad) are copied into the bucket when ready;
// what got none this step is zero there, not last step's value, whether the
// parameter shares its bucket or has one of its own.
TEST(Ddp, GradientsSetToNoneStartFreshEveryStep) {
  for (double cap_mb : {1e-5, 1.0}) {
    RunRanks(2, [cap_mb](int rank, const auto& comm) {
      auto net = std::make_shared<torch::nn::Module>();
      at::Tensor a = net->register_parameter("a", at::ones({4}));
      at::Tensor b = net->register_parameter("b", at::ones({4}));
      DdpOptions o;
      o.bucket_cap_mb = cap_mb;
      o.find_unused_parameters = true;
      DdpStrategy s(o);
      s.Setup(comm, {});
      s.WrapModel(net);
      for (int step = 0; step < 3; ++step) {
        for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();  // zero_grad(set_to_none)
        // Step 0 uses both, step 1 only a (b gets none), step 2 only b.
        at::Tensor loss = at::zeros({}, at::kFloat);
        if (step != 2) loss = loss + (a * static_cast<double>(rank + 1)).sum();
        if (step != 1) loss = loss + (b * static_cast<double>(2 * rank + 3)).sum();
        s.Backward(loss);
        EXPECT_TRUE(at::equal(a.grad(), at::full({4}, step != 2 ? 1.5 : 0.0))) << "step " << step << " " << a.grad();
        EXPECT_TRUE(at::equal(b.grad(), at::full({4}, step != 1 ? 4.0 : 0.0))) << "step " << step << " " << b.grad();
      }
    });
  }
}

TEST(Clip, ValueClipsElementwise) {
  RunRanks(2, [](int rank, const auto& comm) {
    auto tm = shardtrain::testing::MlpWithBatchNorm();
    auto s = StrategyRegistry::Create("fsdp_native");
    s->Setup(comm, {});
    s->WrapModel(tm.make());
    auto [x, y] = tm.data(0, 8);
    at::Tensor loss = tm.loss(s->Forward([&] { return tm.forward(s->module(), x.slice(0, rank * 4, rank * 4 + 4)); }),
                              y.slice(0, rank * 4, rank * 4 + 4));
    s->Backward(loss * 100);
    s->ClipGradients(1e-3, GradClipAlgorithm::kValue);
    for (auto& p : s->parameters()) {
      if (p.grad().defined()) {
        EXPECT_LE(p.grad().abs().max().item<double>(), 1e-3 * (1 + 1e-6));
      }
    }
    const double norm = s->ClipGradNorm(1e9);
    EXPECT_GT(norm, 0);
  });
}


}  // namespace
}  // namespace shardtrain::strategies
