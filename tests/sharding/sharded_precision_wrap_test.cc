// Mixed precision and wrap policies, proven rather than assumed: the dtypes
// parameters and buffers have while a unit computes, the dtype and bytes of
// every reduce-scatter (through a recording communicator), and the units each
// wrap policy makes (names and parameters), in the core and through the
// strategies' options.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <map>
#include <mutex>
#include <set>

#include "base/errors.h"
#include "sharding/sharded_model.h"
#include "strategies/fsdp/fsdp_strategy.h"
#include "strategies/fsdp_native/fsdp_native_strategy.h"
#include "strategies/registry.h"
#include "strategies/sharded_strategy_base.h"
#include "tests/sharding/option_test_models.h"
#include "tests/testing/multi_rank.h"
#include "tests/testing/recording_communicator.h"

namespace shardtrain::sharding {
namespace {

using shardtrain::testing::CommEvent;
using shardtrain::testing::RecordingCommunicator;
using shardtrain::testing::RunRanks;
using testmodels::ChainNetImpl;
using testmodels::g_hooks;
using testmodels::WrapNetImpl;

constexpr auto kF32 = at::kFloat;
constexpr auto kBF16 = at::kBFloat16;
constexpr auto kF16 = at::kHalf;

// What rank 0 saw in two training steps of ChainNet at W=2.
struct PrecisionSeen {
  std::set<at::ScalarType> param_dtypes;   // blocks' weights inside their forward
  std::set<at::ScalarType> buffer_dtypes;  // blocks' "gain" buffers inside their forward
  std::set<at::ScalarType> reduce_dtypes;  // inputs of every reduce-scatter
  std::set<at::ScalarType> master_dtypes;  // what the optimizer steps
  int64_t reduce_bytes = 0;
  int64_t gather_bytes = 0;
};

// `wrap` builds the sharded model: through the core or through a strategy.
using Wrapper = std::function<void(const std::shared_ptr<ChainNetImpl>& net, comm::CommunicatorPtr comm,
                                   std::function<at::Tensor(const std::function<at::Tensor()>&)>& forward,
                                   std::function<std::vector<at::Tensor>()>& params, at::ScalarType& input_dtype)>;

// Keeps each rank's ShardedModel or strategy alive for the run.
thread_local std::shared_ptr<void> t_owner;

PrecisionSeen Train(const Wrapper& wrap) {
  PrecisionSeen seen;
  std::mutex mu;
  RunRanks(2, [&](int rank, const auto& gloo) {
    auto rec = std::make_shared<RecordingCommunicator>(gloo);
    auto net = std::make_shared<ChainNetImpl>(std::vector<int64_t>{6, 8, 10});
    std::function<at::Tensor(const std::function<at::Tensor()>&)> forward;
    std::function<std::vector<at::Tensor>()> params;
    at::ScalarType input_dtype = kF32;
    wrap(net, rec, forward, params, input_dtype);
    PrecisionSeen mine;
    g_hooks.on_forward = [&](int id) {
      mine.param_dtypes.insert(net->b[id]->fc->weight.scalar_type());
      mine.buffer_dtypes.insert(net->b[id]->gain.scalar_type());
    };
    torch::optim::SGD opt(params(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < 2; ++step) {
      at::Tensor x = at::ones({4, 6}).to(input_dtype);
      at::Tensor loss = forward([&] { return net->forward(x); }).to(kF32).pow(2).mean();
      loss.backward();
      opt.step();
      opt.zero_grad();
    }
    g_hooks = {};
    for (auto& p : params()) mine.master_dtypes.insert(p.scalar_type());
    forward = nullptr;
    params = nullptr;
    t_owner.reset();
    for (const auto& e : rec->events()) {
      if (e.kind == CommEvent::Kind::kReduceScatter) mine.reduce_dtypes.insert(e.dtype);
    }
    mine.reduce_bytes = rec->stats().BytesSent(comm::CommOp::kReduceScatter);
    mine.gather_bytes = rec->stats().BytesSent(comm::CommOp::kAllGather);
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) seen = mine;
  });
  return seen;
}

PrecisionSeen TrainCore(ShardingOptions o) {
  return Train([o](const std::shared_ptr<ChainNetImpl>& net, comm::CommunicatorPtr comm, auto& forward, auto& params,
                   at::ScalarType& input_dtype) {
    auto sm = std::make_shared<ShardedModel>(net, comm, o);
    t_owner = sm;
    forward = [sm](const std::function<at::Tensor()>& fn) { return sm->Forward(fn); };
    params = [sm] { return sm->parameters(); };
    input_dtype = sm->compute_dtype();
  });
}

PrecisionSeen TrainStrategy(const std::string& name, const strategies::StrategyOptions& opts) {
  return Train([&](const std::shared_ptr<ChainNetImpl>& net, comm::CommunicatorPtr comm, auto& forward, auto& params,
                   at::ScalarType& input_dtype) {
    std::shared_ptr<strategies::Strategy> s = strategies::StrategyRegistry::Create(name, opts);
    s->Setup(comm, {});
    s->WrapModel(net);
    t_owner = s;
    forward = [s](const std::function<at::Tensor()>& fn) { return s->Forward(fn); };
    params = [s] { return s->parameters(); };
    input_dtype = s->compute_dtype();
  });
}

void ExpectDtypes(const PrecisionSeen& got, at::ScalarType param, at::ScalarType reduce, at::ScalarType buffer,
                  const std::string& label) {
  EXPECT_EQ(got.param_dtypes, std::set<at::ScalarType>{param}) << label;
  EXPECT_EQ(got.reduce_dtypes, std::set<at::ScalarType>{reduce}) << label;
  EXPECT_EQ(got.buffer_dtypes, std::set<at::ScalarType>{buffer}) << label;
  EXPECT_EQ(got.master_dtypes, std::set<at::ScalarType>{kF32}) << label << ": master shards stay float32";
}

TEST(MixedPrecision, CoreComputesReducesAndKeepsBuffersInTheGivenDtypes) {
  const PrecisionSeen fp32 = TrainCore({});
  ExpectDtypes(fp32, kF32, kF32, kF32, "fp32");
  ASSERT_GT(fp32.reduce_bytes, 0);
  ASSERT_GT(fp32.gather_bytes, 0);

  ShardingOptions bf16;
  bf16.mixed_precision.param_dtype = kBF16;  // reduce_dtype follows param_dtype
  bf16.mixed_precision.buffer_dtype = kBF16;
  const PrecisionSeen b = TrainCore(bf16);
  ExpectDtypes(b, kBF16, kBF16, kBF16, "bf16");
  EXPECT_EQ(b.reduce_bytes * 2, fp32.reduce_bytes);
  EXPECT_EQ(b.gather_bytes * 2, fp32.gather_bytes);

  ShardingOptions fp16_reduce32;
  fp16_reduce32.mixed_precision.param_dtype = kF16;
  fp16_reduce32.mixed_precision.reduce_dtype = kF32;
  const PrecisionSeen h = TrainCore(fp16_reduce32);
  ExpectDtypes(h, kF16, kF32, kF32, "fp16 params, fp32 reduce");
  EXPECT_EQ(h.reduce_bytes, fp32.reduce_bytes);
  EXPECT_EQ(h.gather_bytes * 2, fp32.gather_bytes);

  ShardingOptions reduce16;
  reduce16.mixed_precision.reduce_dtype = kF16;
  const PrecisionSeen r = TrainCore(reduce16);
  ExpectDtypes(r, kF32, kF16, kF32, "fp16 reduce only");
  EXPECT_EQ(r.reduce_bytes * 2, fp32.reduce_bytes);

  ShardingOptions buffers_only;
  buffers_only.mixed_precision.buffer_dtype = kBF16;
  ExpectDtypes(TrainCore(buffers_only), kF32, kF32, kBF16, "bf16 buffers only");

  ShardingOptions fp32_rs = bf16;
  fp32_rs.fp32_reduce_scatter = true;
  const PrecisionSeen f = TrainCore(fp32_rs);
  ExpectDtypes(f, kBF16, kF32, kBF16, "bf16 with fp32_reduce_scatter");
  EXPECT_EQ(f.reduce_bytes, fp32.reduce_bytes);
}

TEST(MixedPrecision, FsdpStrategyOptionsReachTheCore) {
  // min_num_params=1: every block large enough is a unit (the default 0 makes every wrap point one).
  const strategies::StrategyOptions units = {{"min_num_params", "1"}};
  auto with = [&](strategies::StrategyOptions extra) {
    extra.insert(units.begin(), units.end());
    return extra;
  };
  const PrecisionSeen fp32 = TrainStrategy("fsdp", units);
  ExpectDtypes(fp32, kF32, kF32, kF32, "fsdp");

  // fairscale: mixed_precision computes in fp16 by default, reduces and keeps buffers in the compute dtype.
  const PrecisionSeen mp = TrainStrategy("fsdp", with({{"mixed_precision", "true"}}));
  ExpectDtypes(mp, kF16, kF16, kF16, "fsdp mixed_precision");
  EXPECT_EQ(mp.reduce_bytes * 2, fp32.reduce_bytes);
  EXPECT_EQ(mp.gather_bytes * 2, fp32.gather_bytes);

  const PrecisionSeen bf = TrainStrategy("fsdp", with({{"mixed_precision", "true"}, {"compute_dtype", "bf16"}}));
  ExpectDtypes(bf, kBF16, kBF16, kBF16, "fsdp compute_dtype=bf16");
  EXPECT_EQ(bf.reduce_bytes * 2, fp32.reduce_bytes);

  const PrecisionSeen rs32 =
      TrainStrategy("fsdp", with({{"mixed_precision", "true"}, {"fp32_reduce_scatter", "true"}}));
  ExpectDtypes(rs32, kF16, kF32, kF16, "fsdp fp32_reduce_scatter");
  EXPECT_EQ(rs32.reduce_bytes, fp32.reduce_bytes);

  ExpectDtypes(TrainStrategy("fsdp", with({{"mixed_precision", "true"}, {"buffer_dtype", "fp32"}})), kF16, kF16,
               kF32, "fsdp buffer_dtype=fp32");

  // fsdp_native's MixedPrecision fields.
  ExpectDtypes(TrainStrategy("fsdp_native", {{"param_dtype", "bf16"}, {"reduce_dtype", "fp32"}}), kBF16, kF32, kF32,
               "fsdp_native param_dtype=bf16 reduce_dtype=fp32");
  ExpectDtypes(TrainStrategy("fsdp_native", {{"mixed_precision", "fp16"}}), kF16, kF16, kF16,
               "fsdp_native mixed_precision=fp16");
}

// --- wrap policies -------------------------------------------------------------

struct Layout {
  std::vector<std::string> names;                       // unit names, root ("") last
  std::map<std::string, std::vector<std::string>> params;  // unit name -> parameter names
};

Layout LayoutOf(const std::vector<UnitInfo>& units) {
  Layout l;
  for (const auto& u : units) {
    l.names.push_back(u.name);
    l.params[u.name] = u.param_names;
  }
  return l;
}

Layout CoreLayout(const WrapPolicy& policy, int world = 2) {
  Layout out;
  RunRanks(world, [&](int rank, const auto& comm) {
    ShardedModel sm(std::make_shared<WrapNetImpl>(), comm, {}, policy);
    if (rank == 0) out = LayoutOf(sm.units());
  });
  return out;
}

Layout StrategyLayout(const std::function<strategies::StrategyPtr()>& make) {
  Layout out;
  RunRanks(2, [&](int rank, const auto& comm) {
    auto s = make();
    s->Setup(comm, {});
    s->WrapModel(std::make_shared<WrapNetImpl>());
    if (rank == 0) out = LayoutOf(dynamic_cast<strategies::ShardedStrategyBase&>(*s).sharded_model().units());
  });
  return out;
}

Layout StrategyLayout(const std::string& name, const strategies::StrategyOptions& opts) {
  return StrategyLayout([&] { return strategies::StrategyRegistry::Create(name, opts); });
}

using Names = std::vector<std::string>;

// A wrap policy written in C++ (PyTorch's callable auto_wrap_policy) reaches
// the core through both strategies' typed options: here only wrap points of
// fewer than 50 parameters, which no string policy selects.
TEST(WrapPolicies, ACppPolicyThroughTypedStrategyOptions) {
  const sharding::WrapPolicy small{[](const WrapPoint&, int64_t numel) { return numel < 50; }};
  strategies::FsdpNativeOptions native;
  native.auto_wrap_policy_fn = small;
  EXPECT_EQ(StrategyLayout([&] { return std::make_shared<strategies::FsdpNativeStrategy>(native); }).names,
            (Names{"a", ""}));
  strategies::FsdpOptions fairscale;
  fairscale.auto_wrap_policy_fn = small;
  EXPECT_EQ(StrategyLayout([&] { return std::make_shared<strategies::FsdpStrategy>(fairscale); }).names,
            (Names{"a", ""}));
  // Not beside a string policy that would also decide.
  native.auto_wrap_policy = "never";
  EXPECT_THROW(strategies::FsdpNativeStrategy{native}, InvalidArgumentError);
  fairscale.min_num_params = 100;
  EXPECT_THROW(strategies::FsdpStrategy{fairscale}, InvalidArgumentError);
}

// WrapNet: a (9 parameters), b (110), c (its own proj: 22) holding c.inner (110), head (4).
TEST(WrapPolicies, EachPolicyMakesItsUnits) {
  EXPECT_EQ(CoreLayout(WrapPolicy::Always()).names, (Names{"a", "b", "c", "c.inner", ""}));
  EXPECT_EQ(CoreLayout(WrapPolicy::Never()).names, (Names{""}));

  // Size: a nested unit's parameters do not count for its parent.
  Layout size100 = CoreLayout(WrapPolicy::SizeBased(100));
  EXPECT_EQ(size100.names, (Names{"b", "c.inner", ""}));
  EXPECT_EQ(size100.params[""], (Names{"a.fc.weight", "a.fc.bias", "c.proj.weight", "c.proj.bias", "head.weight",
                                       "head.bias"}));
  EXPECT_EQ(size100.params["c.inner"], (Names{"c.inner.fc.weight", "c.inner.fc.bias"}));
  EXPECT_EQ(CoreLayout(WrapPolicy::SizeBased(20)).names, (Names{"b", "c", "c.inner", ""}));
  // c.inner (110) declined at 111, so c counts it: 132.
  EXPECT_EQ(CoreLayout(WrapPolicy::SizeBased(111)).names, (Names{"c", ""}));
  EXPECT_EQ(CoreLayout(WrapPolicy::SizeBased(133)).names, (Names{""}));

  // Type: the full name or its trailing "::" parts.
  EXPECT_EQ(CoreLayout(WrapPolicy::ByType({"BigImpl"})).names, (Names{"b", "c.inner", ""}));
  Layout outer = CoreLayout(WrapPolicy::ByType({"testmodels::OuterImpl"}));
  EXPECT_EQ(outer.names, (Names{"c", ""}));
  EXPECT_EQ(outer.params["c"], (Names{"c.inner.fc.weight", "c.inner.fc.bias", "c.proj.weight", "c.proj.bias"}));
  EXPECT_EQ(CoreLayout(WrapPolicy::ByType({"shardtrain::testmodels::SmallImpl"})).names, (Names{"a", ""}));
  EXPECT_EQ(CoreLayout(WrapPolicy::ByType({"Impl", "mallImpl", "other::BigImpl"})).names, (Names{""}));

  // Custom: a lambda over the wrap point and the parameters no nested unit took.
  std::vector<std::pair<std::string, int64_t>> asked;
  WrapPolicy custom{[&](const WrapPoint& p, int64_t numel) {
    const std::string t = p.WrapTypeName();
    asked.emplace_back(t.substr(t.rfind(':') + 1), numel);
    return t.find("OuterImpl") != std::string::npos || numel < 10;
  }};
  Layout c = CoreLayout(custom, /*world=*/1);  // one rank asks, in order
  EXPECT_EQ(c.names, (Names{"a", "c", ""}));
  EXPECT_EQ(c.params["c"].size(), 4u);
  // Deepest wrap points are asked first; c.inner declined, so c counts its parameters too.
  using Asked = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(asked, (Asked{{"BigImpl", 110}, {"OuterImpl", 132}, {"BigImpl", 110}, {"SmallImpl", 9}}));
}

TEST(WrapPolicies, StrategyOptionsMapToThePolicies) {
  EXPECT_EQ(StrategyLayout("fsdp_native", {}).names, (Names{"a", "b", "c", "c.inner", ""}));
  EXPECT_EQ(StrategyLayout("fsdp_native", {{"auto_wrap_policy", "always"}}).names,
            (Names{"a", "b", "c", "c.inner", ""}));
  EXPECT_EQ(StrategyLayout("fsdp_native", {{"auto_wrap_policy", "never"}}).names, (Names{""}));
  EXPECT_EQ(StrategyLayout("fsdp_native", {{"auto_wrap_policy", "size:100"}}).names, (Names{"b", "c.inner", ""}));
  EXPECT_EQ(StrategyLayout("fsdp_native", {{"auto_wrap_policy", "size:20"}}).names,
            (Names{"b", "c", "c.inner", ""}));
  EXPECT_EQ(StrategyLayout("fsdp_native", {{"auto_wrap_policy", "type:testmodels::OuterImpl"}}).names,
            (Names{"c", ""}));
  EXPECT_EQ(StrategyLayout("fsdp_native", {{"auto_wrap_policy", "type:BigImpl, SmallImpl"}}).names,
            (Names{"a", "b", "c.inner", ""}));
  // Default min_num_params 0: every Sharded<> wrap point is a unit (fairscale's wrap()).
  EXPECT_EQ(StrategyLayout("fsdp", {}).names, (Names{"a", "b", "c", "c.inner", ""}));
  EXPECT_EQ(StrategyLayout("fsdp", {{"min_num_params", "100000000"}}).names, (Names{""}));
  EXPECT_EQ(StrategyLayout("fsdp", {{"min_num_params", "100"}}).names, (Names{"b", "c.inner", ""}));
  EXPECT_EQ(StrategyLayout("fsdp", {{"min_num_params", "0"}}).names, (Names{"a", "b", "c", "c.inner", ""}));
}

}  // namespace
}  // namespace shardtrain::sharding
