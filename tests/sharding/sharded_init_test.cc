// ShardedInitScope: a model built under the scope never holds more than this
// rank's shards plus one unit, has the same weights as one built plainly from
// the same seed, and trains exactly like it. Threads-as-ranks over real Gloo.
#include "sharding/sharded_init.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/errors.h"
#include "sharding/sharded_model.h"
#include "sharding/source_release.h"
#include "strategies/registry.h"
#include "strategies/sharded_strategy_base.h"
#include "tests/sharding/sharded_init_net.h"
#include "tests/testing/counting_allocator.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::sharding {
namespace {

using shardtrain::testing::RunRanks;
using namespace shardtrain::sharding::init_net;  // NOLINT: the test models

TEST(ShardedInit, SameWeightsAsPlainConstructionAtW124) {
  for (int W : {1, 2, 4}) {
    RunRanks(W, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
      auto plain = BuildLocked<NetImpl>(5, nullptr);
      auto scoped = BuildLocked<NetImpl>(5, [&] {
        auto s = std::make_unique<ShardedInitScope>(*comm, ShardingOptions{});
        return s;
      });
      // While unadopted, wrapped parameters hold no values; root ones do.
      EXPECT_TRUE(StorageIsFreed(scoped->b0->inner->a->weight));
      EXPECT_TRUE(StorageIsFreed(scoped->b1->proj->weight));
      EXPECT_FALSE(StorageIsFreed(scoped->emb->weight));
      ShardedModel sm(scoped, comm, ShardingOptions{});
      std::vector<std::string> names;
      for (const auto& u : sm.units()) names.push_back(u.name);
      EXPECT_EQ(names, (std::vector<std::string>{"b0", "b0.inner", "b1", "b1.inner", ""}));
      auto sd = sm.FullStateDict(/*rank0_only=*/false);
      auto want = Values(*plain);
      want["b0.shared"] = want["b1.shared"] = want["w"];
      ExpectBitEqual(sd, want);
    });
  }
}

// HYBRID_SHARD: the scope made from the world and the options shards over the
// same 2-rank groups as the ShardedModel.
TEST(ShardedInit, SameWeightsWithHybridShardAtW4) {
  RunRanks(4, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    ShardingOptions options;
    options.sharding_strategy = ShardingStrategy::kHybridShard;
    options.hybrid_shard_group_size = 2;
    auto plain = BuildLocked<NetImpl>(6, nullptr);
    auto scoped = BuildLocked<NetImpl>(6, [&] { return std::make_unique<ShardedInitScope>(*comm, options); });
    ShardedModel sm(scoped, comm, options);
    EXPECT_EQ(sm.shard_group()->size(), 2);
    EXPECT_EQ(sm.units()[1].shard_numel, (sm.units()[1].numel + 1) / 2);
    ExpectBitEqual(sm.FullStateDict(false), Values(*plain));
  });
}

TEST(ShardedInit, TrainsLikePlainConstructionAtW2) {
  RunRanks(2, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    std::vector<double> losses[2];
    std::map<std::string, at::Tensor> final_state[2];
    for (int scoped : {0, 1}) {
      auto net = BuildLocked<NetImpl>(9, scoped ? std::function<std::unique_ptr<ShardedInitScope>()>([&] {
        return std::make_unique<ShardedInitScope>(*comm, ShardingOptions{});
      })
                                                : nullptr);
      ShardedModel sm(net, comm, ShardingOptions{});
      torch::optim::Adam opt(sm.parameters(), torch::optim::AdamOptions(1e-2));
      auto g = at::detail::createCPUGenerator(100 + rank);
      for (int step = 0; step < 4; ++step) {
        at::Tensor x = at::randn({4, 8}, g);
        at::Tensor y = at::randn({4}, g);
        opt.zero_grad();
        at::Tensor loss = (sm.Forward([&] { return net->forward(x); }) - y).pow(2).mean();
        loss.backward();
        opt.step();
        losses[scoped].push_back(loss.item<double>());
      }
      final_state[scoped] = sm.FullStateDict(/*rank0_only=*/false);
    }
    EXPECT_EQ(losses[0], losses[1]);
    ExpectBitEqual(final_state[1], final_state[0]);
  });
}

// Parameters frozen after construction, or a ShardedModel with another wrap
// policy: the prebuilt shards do not fit the units built, which are gathered
// back and built as usual; the weights stay those of plain construction.
TEST(ShardedInit, UnitsThatChangedAfterConstructionAreGatheredBack) {
  RunRanks(2, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    auto plain = BuildLocked<NetImpl>(3, nullptr);
    auto want = Values(*plain);
    want["b0.shared"] = want["b1.shared"] = want["w"];
    auto make_scope = [&] { return std::make_unique<ShardedInitScope>(*comm, ShardingOptions{}); };
    {
      auto net = BuildLocked<NetImpl>(3, make_scope);
      net->b1->proj->weight.set_requires_grad(false);
      ShardedModel sm(net, comm, ShardingOptions{});
      ExpectBitEqual(sm.FullStateDict(false), want);
      ASSERT_EQ(sm.units()[2].name, "b1");
      EXPECT_EQ(sm.units()[2].param_names, (std::vector<std::string>{"b1.proj.bias", "b1.proj.weight"}))
          << "the weight frozen after construction is laid out after the trainable bias";
    }
    {
      auto net = BuildLocked<NetImpl>(3, make_scope);
      ShardedModel sm(net, comm, ShardingOptions{}, WrapPolicy::Never());
      EXPECT_EQ(sm.num_units(), 1);
      ExpectBitEqual(sm.FullStateDict(false), want);
    }
  });
}

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(ShardedInit, ClearErrors) {
  RunRanks(2, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    // Ranks that built different weights are named by wrap point.
    auto net = BuildLocked<NetImpl>(20 + rank, [&] { return std::make_unique<ShardedInitScope>(*comm, ShardingOptions{}); });
    std::string msg = ErrorOf([&] { ShardedModel sm(net, comm, ShardingOptions{}); });
    EXPECT_NE(msg.find("wrap point 'b0' was sharded at construction (ShardedInitScope) with different initial "
                       "values"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("at::manual_seed"), std::string::npos) << msg;
    // A scope for another shard group than the ShardedModel's.
    auto other = BuildLocked<NetImpl>(1, [&] { return std::make_unique<ShardedInitScope>(ShardGroupPlace{0, 1}); });
    ShardingOptions no_sync;
    no_sync.sync_module_states = false;
    msg = ErrorOf([&] { ShardedModel sm(other, comm, no_sync); });
    EXPECT_NE(msg.find("wrap point 'b0' was sharded at construction for shard rank 0 of 1, but this ShardedModel's "
                       "shard group makes this rank " +
                       std::to_string(rank) + " of 2"),
              std::string::npos)
        << msg;
    msg = ErrorOf([&] { ShardedInitScope bad(ShardGroupPlace{2, 2}); });
    EXPECT_NE(msg.find("shard rank 2 is not in a shard group of 2 (valid: 0..size-1"), std::string::npos) << msg;
  });
}

// N identical units: the peak memory budget of construction.
class UnitImpl : public torch::nn::Module {
 public:
  UnitImpl() { fc = register_module("fc", torch::nn::Linear(256, 256)); }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};
constexpr int kUnits = 16;
class StackImpl : public torch::nn::Module {
 public:
  StackImpl() {
    for (int i = 0; i < kUnits; ++i) {
      units.push_back(register_module("u" + std::to_string(i), std::make_shared<Sharded<UnitImpl>>()));
    }
  }
  std::vector<std::shared_ptr<Sharded<UnitImpl>>> units;
};

TEST(ShardedInit, PeakWhileConstructingIsShardsPlusOneUnit) {
  shardtrain::testing::InstallCountingCpuAllocator();
  constexpr int W = 4;
  constexpr int64_t kUnitNumel = 256 * 256 + 256;
  constexpr int64_t kShardBytes = (kUnitNumel + W - 1) / W * 4;
  constexpr int64_t kBound = static_cast<int64_t>((kUnits * kShardBytes + kUnitNumel * 4) * 1.15) + 64 * 1024;
  RunRanks(W, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    using shardtrain::testing::LiveCpuBytesOfThisThread;
    using shardtrain::testing::PeakCpuBytesOfThisThread;
    using shardtrain::testing::ResetPeakCpuBytesOfThisThread;
    int64_t base = LiveCpuBytesOfThisThread();
    ResetPeakCpuBytesOfThisThread();
    std::shared_ptr<StackImpl> scoped;
    {
      ShardedInitScope scope(*comm, ShardingOptions{});
      scoped = std::make_shared<StackImpl>();
      EXPECT_EQ(scope.units_built(), kUnits);
      EXPECT_EQ(scope.shard_bytes(), kUnits * kShardBytes);
    }
    const int64_t scoped_peak = PeakCpuBytesOfThisThread() - base;
    {
      ShardingOptions options;
      options.sync_module_states = false;  // rank threads built concurrently: their weights differ
      ShardedModel sm(scoped, comm, options);  // adopts the shards
      EXPECT_LE(PeakCpuBytesOfThisThread() - base, kBound) << "construction + ShardedModel";
    }
    base = LiveCpuBytesOfThisThread();
    ResetPeakCpuBytesOfThisThread();
    auto plain = std::make_shared<StackImpl>();
    const int64_t plain_peak = PeakCpuBytesOfThisThread() - base;
    if (rank == 0) {
      std::printf("W=%d, %d units of %lld bytes: construction peak %lld bytes under ShardedInitScope, %lld without; "
                  "bound (own shards + one unit) x 1.15 + 64 KiB = %lld\n",
                  W, kUnits, static_cast<long long>(kUnitNumel * 4), static_cast<long long>(scoped_peak),
                  static_cast<long long>(plain_peak), static_cast<long long>(kBound));
    }
    EXPECT_LE(scoped_peak, kBound);
    EXPECT_GT(plain_peak, kBound) << "the bound must be able to fail: plain construction holds the whole model";
  });
}

// A full checkpoint loads record by record, each rank taking only its slice:
// ShardOfFull equals the slice of what Flatten builds (uneven sizes, padding
// 0, W=1..4), allocates nothing beyond the shard (Flatten builds the whole
// unit), and hands every source to the active SourceReleaseScope once.
std::vector<const void*> g_released;
void NoteReleased(const at::Tensor& t) { g_released.push_back(t.const_data_ptr()); }

TEST(ShardedInit, ShardOfFullReadsOnlyThisRanksSlice) {
  shardtrain::testing::InstallCountingCpuAllocator();
  const std::vector<std::vector<int64_t>> shapes = {{300, 50}, {7001}, {20, 20, 20}};  // 30001 elements
  for (int world : {1, 2, 3, 4}) {
    for (int rank = 0; rank < world; ++rank) {
      std::vector<FlatParamEntry> entries;
      std::vector<at::Tensor> full;
      for (size_t i = 0; i < shapes.size(); ++i) {
        FlatParamEntry e;
        e.name = "p" + std::to_string(i);
        e.param = at::randn(shapes[i]);
        full.push_back(e.param.detach().clone());
        entries.push_back(std::move(e));
      }
      FlatParameter flat("u", std::move(entries), rank, world);
      at::Tensor want = flat.Flatten(full, at::kFloat).narrow(0, flat.shard_offset(), flat.shard_numel());
      g_released.clear();
      at::Tensor got;
      const int64_t base = shardtrain::testing::LiveCpuBytesOfThisThread();
      shardtrain::testing::ResetPeakCpuBytesOfThisThread();
      {
        SourceReleaseScope scope(&NoteReleased);
        got = flat.ShardOfFull(full, at::kFloat);
      }
      const int64_t peak = shardtrain::testing::PeakCpuBytesOfThisThread() - base;
      EXPECT_TRUE(at::equal(got, want)) << "W=" << world << " rank " << rank;
      EXPECT_LE(peak, flat.shard_numel() * 4 + 1024) << "W=" << world << " rank " << rank << ": more than the shard";
      ASSERT_EQ(g_released.size(), full.size());
      for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(g_released[i], full[i].const_data_ptr());
      flat.ShardOfFull(full, at::kFloat);  // without a scope: nothing released
      EXPECT_EQ(g_released.size(), full.size());
    }
  }
}

// A wrapped parameter read or written between construction and wrapping (a
// configure_model that initialises after building) throws naming it and the
// option, instead of touching freed memory; once wrapped, everything works.
TEST(ShardedInit, TouchingAFreedParameterThrowsNamingIt) {
  RunRanks(2, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    auto net = BuildLocked<NetImpl>(6, [&] { return std::make_unique<ShardedInitScope>(*comm, ShardingOptions{}); });
    at::Tensor w = net->b0->inner->a->weight;
    ASSERT_TRUE(StorageIsFreed(w));
    const std::vector<std::pair<std::string, std::function<void()>>> touches = {
        {"read", [&] { (void)w.sum().item<double>(); }},
        {"write", [&] {
           at::NoGradGuard no_grad;
           w.copy_(at::zeros_like(w));
         }},
        {"init", [&] { torch::nn::init::normal_(w); }},  // as a configure_model's init would
    };
    for (const auto& [what, touch] : touches) {
      std::string msg = "<no error>";
      try {
        touch();
      } catch (const c10::Error& e) {
        msg = e.what();
      }
      EXPECT_NE(msg.find("parameters 'a.weight', 'a.bias', 'b.weight', 'b.bias' of a Sharded<"), std::string::npos)
          << what << ": " << msg;
      EXPECT_NE(msg.find("set sharded_construction=false"), std::string::npos) << what << ": " << msg;
    }
    ShardedModel sm(net, comm, ShardingOptions{});
    at::Tensor x = at::ones({2, 8});
    EXPECT_TRUE(sm.Forward([&] { return net->forward(x); }).isfinite().all().item<bool>());
    auto sd = sm.FullStateDict(true);
    if (rank == 0) {
      auto want = Values(*BuildLocked<NetImpl>(6, nullptr));
      EXPECT_TRUE(at::equal(sd.at("b0.inner.a.weight"), want.at("b0.inner.a.weight")));
    }
  });
}

// MoveToDevice (what the Trainer calls instead of Module::to for a GPU) to
// the device the model is on changes nothing: the wrapped parameters stay
// valueless and the model wraps to the plain construction's values. (Its CUDA
// side, shards moved and whole units never, needs a GPU:
// tests/cuda/cuda_fixes_test ShardedConstructionMovesShardsToTheGpu. No CPU
// device type stands in for one: Tensor::set_data refuses meta tensors.)
TEST(ShardedInit, MoveToDeviceOnTheSameDeviceKeepsTheShards) {
  RunRanks(2, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    auto built = BuildLocked<NetImpl>(8, [&] { return std::make_unique<ShardedInitScope>(*comm, ShardingOptions{}); });
    ShardedInitScope::MoveToDevice(*built, c10::Device(c10::kCPU));
    EXPECT_TRUE(StorageIsFreed(built->b0->inner->a->weight));
    EXPECT_FALSE(StorageIsFreed(built->emb->weight));
    ShardedModel sm(built, comm, ShardingOptions{});
    auto sd = sm.FullStateDict(true);
    if (rank == 0) {
      auto want = Values(*BuildLocked<NetImpl>(8, nullptr));
      want["b0.shared"] = want["b1.shared"] = want["w"];
      ExpectBitEqual(sd, want);
    }
  });
}

// The strategies offer the scope (on by default) for the Trainer to hold
// around configure_model.
// At W=1 too: the scope flattens unit by unit, so one rank never holds the
// model twice (construction, then the copy into the flat parameters).
TEST(ShardedInit, StrategyConstructionScope) {
  for (int W : {1, 2}) RunRanks(W, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    for (const char* name : {"fsdp_native", "fsdp"}) {
      auto s = strategies::StrategyRegistry::Create(name);
      auto* base = dynamic_cast<strategies::ShardedStrategyBase*>(s.get());
      ASSERT_NE(base, nullptr);
      ClusterInfo ci;
      ci.rank = rank;
      ci.world_size = W;
      ci.local_world_size = W;
      s->Setup(comm, ci);
      EXPECT_TRUE(s->sharded_construction()) << name << ": on by default";
      base->set_sharded_construction(false);
      EXPECT_EQ(s->MakeConstructionScope(), nullptr) << name << ": off when set so";
      EXPECT_FALSE(strategies::StrategyRegistry::Create(name, {{"sharded_construction", "false"}})
                       ->sharded_construction()) << name << ": the string option";
      base->set_sharded_construction(true);
      std::shared_ptr<NetImpl> net;
      {
        static std::mutex mu;
        std::lock_guard<std::mutex> lock(mu);
        at::manual_seed(4);
        auto scope = s->MakeConstructionScope();
        ASSERT_NE(scope, nullptr) << name << " at W=" << W;
        net = std::make_shared<NetImpl>();
      }
      EXPECT_TRUE(StorageIsFreed(net->b0->inner->a->weight)) << name << " at W=" << W;
      s->WrapModel(net);
      auto plain = BuildLocked<NetImpl>(4, nullptr);
      auto want = Values(*plain);
      want["b0.shared"] = want["b1.shared"] = want["w"];
      auto sd = s->FullStateDict();
      if (rank == 0) ExpectBitEqual(sd, want);
    }
  });
}

}  // namespace
}  // namespace shardtrain::sharding
