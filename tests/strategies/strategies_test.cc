// Strategies through the Strategy interface only: registry errors, invalid
// combinations, CPU offload translation, bf16-true refusal by sharded
// strategies, fsdp's default wrap policy, and parity: fsdp, fsdp_native (several settings) and ddp at
// W=2 give the same losses and parameters as single_device on the same global
// batch, with gradient accumulation (no_sync) and norm clipping.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "base/errors.h"
#include "sharding/wrap_point.h"
#include "strategies/ddp/ddp_strategy.h"
#include "strategies/fsdp/fsdp_strategy.h"
#include "strategies/fsdp_native/fsdp_native_strategy.h"
#include "strategies/registry.h"
#include "tests/testing/models.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::strategies {
namespace {

using shardtrain::testing::RunRanks;

template <typename F>
std::string ErrorOf(F&& f) {
  try {
    f();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "<no InvalidArgumentError>";
}

TEST(Registry, KnowsEveryStrategy) {
  for (const char* n : {"ddp", "ddp_fully_sharded", "fsdp", "fsdp_native", "fsdp_native_full_shard_offload",
                        "single_device"}) {
    EXPECT_TRUE(StrategyRegistry::Has(n)) << n;
    EXPECT_EQ(StrategyRegistry::Create(n)->name(), n);
  }
}

TEST(Registry, UnknownNameListsRegistered) {
  std::string msg = ErrorOf([] { StrategyRegistry::Create("fsdp_nativ"); });
  EXPECT_NE(msg.find("unknown strategy 'fsdp_nativ'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ddp, ddp_fully_sharded, fsdp, fsdp_native"), std::string::npos) << msg;
}

TEST(Registry, UnknownOptionListsValidKeys) {
  std::string msg = ErrorOf([] { StrategyRegistry::Create("fsdp_native", {{"reshard_after_forward", "true"}}); });
  EXPECT_NE(msg.find("unknown option reshard_after_forward"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sharding_strategy"), std::string::npos) << msg;
  msg = ErrorOf([] { StrategyRegistry::Create("fsdp", {{"sharding_strategy", "FULL_SHARD"}}); });
  EXPECT_NE(msg.find("unknown option sharding_strategy"), std::string::npos) << msg;
  EXPECT_NE(msg.find("reshard_after_forward"), std::string::npos) << msg;
}

// The strategies' option tables are the valid-key lists: the registry's
// check and FromStrings' name the same keys, and every documented key parses.
TEST(OptionReference, TablesAreTheValidKeys) {
  for (const auto& name : StrategyRegistry::Names()) {
    const auto docs = StrategyRegistry::Options(name);
    EXPECT_EQ(StrategyRegistry::ValidKeys(name), OptionKeys(docs)) << name;
    const std::string msg = ErrorOf([&] { StrategyRegistry::Create(name, {{"no_such_option", "1"}}); });
    for (const auto& d : docs) EXPECT_NE(msg.find(d.key), std::string::npos) << name << ": " << msg;
  }
  const std::string direct = ErrorOf([] { FsdpNativeOptions::FromStrings({{"no_such_option", "1"}}); });
  EXPECT_NE(direct.find("unknown option no_such_option"), std::string::npos) << direct;
  for (const auto& key : FsdpNativeOptions::Table().Keys()) EXPECT_NE(direct.find(key), std::string::npos) << key;
  // Each row sets its field: a boolean row of each table flips a default.
  EXPECT_TRUE(FsdpNativeOptions::FromStrings({{"offload_params", "true"}}).cpu_offload);
  EXPECT_FALSE(FsdpOptions::FromStrings({{"state_dict_to_cpu", "false"}}).state_dict_to_cpu);
  // ... which the strategy refuses: state dicts and checkpoints are always gathered to the host.
  const std::string to_device = ErrorOf([] { StrategyRegistry::Create("fsdp", {{"state_dict_to_cpu", "false"}}); });
  EXPECT_NE(to_device.find("state_dict_to_cpu=false is not supported"), std::string::npos) << to_device;
  EXPECT_FALSE(DdpOptions::FromStrings({{"broadcast_buffers", "no"}}).broadcast_buffers);
  EXPECT_EQ(FsdpNativeOptions::FromStrings({{"hybrid_shard_group_size", "4"}}).sharding.hybrid_shard_group_size, 4);
}

// docs/strategy_options.md is generated from the tables; `tools/bazel run
// //tests/strategies:strategies_test -- --gtest_filter=OptionReference.*`
// rewrites it.
TEST(OptionReference, DocsMatchTables) {
  const std::string generated = StrategyRegistry::OptionReference();
  if (const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY")) {
    std::ofstream(std::string(workspace) + "/docs/strategy_options.md") << generated;
    return;
  }
  std::ifstream in("docs/strategy_options.md");
  ASSERT_TRUE(in.good()) << "docs/strategy_options.md is not among the test's data files";
  std::stringstream file;
  file << in.rdbuf();
  EXPECT_EQ(file.str(), generated)
      << "docs/strategy_options.md does not match the strategies' option tables; regenerate it with "
         "tools/bazel run //tests/strategies:strategies_test -- --gtest_filter=OptionReference.*";
}

// The reference is valid Markdown: a '|' inside a cell (values such as
// true|false) is escaped, so every table row has exactly three cells; each
// option table is listed once, under the strategy's own name, and its aliases
// and presets point there.
TEST(OptionReference, CellsEscapedAndTablesUnderTheirOwnName) {
  EXPECT_EQ(MarkdownCell("true|false"), "true\\|false");
  const std::string ref = StrategyRegistry::OptionReference();
  std::istringstream lines(ref);
  int rows = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '|') continue;
    int bars = 0;
    for (size_t i = 0; i < line.size(); ++i) bars += line[i] == '|' && (i == 0 || line[i - 1] != '\\');
    EXPECT_EQ(bars, 4) << "a table row without exactly three cells: " << line;
    ++rows;
  }
  EXPECT_GT(rows, 30);
  auto section = [&](const std::string& name) {
    const size_t at = ref.find("\n## " + name + "\n");
    EXPECT_NE(at, std::string::npos) << name;
    return at == std::string::npos ? std::string() : ref.substr(at + 1, ref.find("\n## ", at + 1) - at - 1);
  };
  EXPECT_NE(section("fsdp").find("| `reshard_after_forward` |"), std::string::npos) << section("fsdp");
  EXPECT_NE(section("ddp_fully_sharded").find("Options as `fsdp`."), std::string::npos);
  EXPECT_NE(section("fsdp_native").find("| `sharding_strategy` |"), std::string::npos);
  EXPECT_NE(section("fsdp_native_full_shard_offload").find("Options as `fsdp_native`."), std::string::npos);
}

TEST(Registry, InvalidValuesAndCombinations) {
  auto has = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
  };
  has(ErrorOf([] { StrategyRegistry::Create("fsdp", {{"flatten_parameters", "false"}}); }),
      "flatten_parameters=false is not supported");
  has(ErrorOf([] { StrategyRegistry::Create("fsdp", {{"fp32_reduce_scatter", "true"}}); }),
      "requires mixed_precision=true");
  has(ErrorOf([] { StrategyRegistry::Create("fsdp", {{"cpu_offload", "yes"}}); }), "requires mixed_precision=true");
  has(ErrorOf([] { StrategyRegistry::Create("fsdp", {{"reshard_after_forward", "maybe"}}); }), "is not a boolean");
  has(ErrorOf([] { StrategyRegistry::Create("fsdp_native", {{"param_dtype", "int8"}}); }), "valid: bf16, fp16, fp32");
  has(ErrorOf([] { StrategyRegistry::Create("fsdp_native", {{"sharding_strategy", "ZERO3"}}); }),
      "valid: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD");
  has(ErrorOf([] { StrategyRegistry::Create("fsdp_native", {{"state_dict_type", "local"}}); }), "valid: full, sharded");
  has(ErrorOf([] { StrategyRegistry::Create("fsdp_native", {{"auto_wrap_policy", "big"}}); }),
      "valid: always, never, size:N, type:TypeA,TypeB");
  has(ErrorOf([] { StrategyRegistry::Create("fsdp_native", {{"hybrid_shard_group_size", "2"}}); }),
      "only valid with sharding_strategy=HYBRID_SHARD");
  has(ErrorOf([] { StrategyRegistry::Create("ddp", {{"bucket_cap_mb", "-1"}}); }), "bucket_cap_mb must be > 0");
  // fsdp has no bucketing across units: only fairscale's "no bucketing" (0) is accepted.
  has(ErrorOf([] { StrategyRegistry::Create("fsdp", {{"bucket_cap_mb", "25"}}); }),
      "bucket_cap_mb=25 is not supported: ShardTrain reduce-scatters each unit's gradient as one collective");
  EXPECT_EQ(ErrorOf([] { StrategyRegistry::Create("fsdp", {{"bucket_cap_mb", "0"}}); }), "<no InvalidArgumentError>");
  // HYBRID_SHARD whose group size does not divide the world size: at Setup.
  has(ErrorOf([] {
        RunRanks(2, [](int, const auto& comm) {
          auto s = StrategyRegistry::Create(
              "fsdp_native", {{"sharding_strategy", "HYBRID_SHARD"}, {"hybrid_shard_group_size", "3"}});
          s->Setup(comm, {});
        });
      }),
      "does not divide the world size 2");
}

// The Trainer's precision names are parsed once, from one table (the example
// flags' choices come from it too).
TEST(Registry, PrecisionIsParsedFromOneTable) {
  ASSERT_EQ(PrecisionNames().size(), 4u);
  for (const auto& n : PrecisionNames()) EXPECT_EQ(PrecisionName(ParsePrecision(n)), n);
  EXPECT_EQ(ParsePrecision("16-mixed"), Precision::k16Mixed);
  const std::string msg = ErrorOf([] { ParsePrecision("fp8"); });
  EXPECT_NE(msg.find("unknown precision 'fp8'; valid: 32-true, bf16-mixed, 16-mixed, bf16-true"), std::string::npos)
      << msg;
}

TEST(Registry, TypedOptions) {
  auto o = FsdpNativeOptions::FromStrings(
      {{"mixed_precision", "bf16"}, {"reduce_dtype", "fp32"}, {"auto_wrap_policy", "type:MlpBlockImpl"}});
  EXPECT_EQ(*o.sharding.mixed_precision.param_dtype, at::kBFloat16);
  EXPECT_EQ(*o.sharding.mixed_precision.reduce_dtype, at::kFloat);
  auto f = FsdpOptions::FromStrings({{"min_num_params", "1e8"}, {"reshard_after_forward", "false"}});
  EXPECT_EQ(f.min_num_params, 100000000);
  FsdpStrategy fs(f);
  EXPECT_EQ(fs.sharding_options().sharding_strategy, sharding::ShardingStrategy::kShardGradOp);
  auto off = StrategyRegistry::Create("fsdp_native_full_shard_offload");
  EXPECT_TRUE(static_cast<FsdpNativeStrategy&>(*off).options().cpu_offload);
  // The rows set the core's options directly; the constructor hands them on.
  auto n = FsdpNativeOptions::FromStrings({{"limit_all_gathers", "false"}, {"forward_prefetch", "true"}});
  FsdpNativeStrategy ns(n);
  EXPECT_EQ(ns.sharding_options().limit_all_gathers, 0);
  EXPECT_TRUE(ns.sharding_options().forward_prefetch);
  auto g = FsdpOptions::FromStrings({{"gradient_predivide_factor", "2"}, {"mixed_precision", "true"},
                                     {"fp32_reduce_scatter", "true"}});
  FsdpStrategy gs(g);
  EXPECT_EQ(gs.sharding_options().gradient_predivide_factor, 2);
  EXPECT_TRUE(gs.sharding_options().fp32_reduce_scatter);
  EXPECT_EQ(*gs.sharding_options().mixed_precision.reduce_dtype, at::kFloat);
  // Core fields a strategy decides itself are refused when set directly.
  FsdpNativeOptions offload;
  offload.sharding.offload_params = true;
  const std::string msg = ErrorOf([&] { FsdpNativeStrategy s(offload); });
  EXPECT_NE(msg.find("set cpu_offload=true, not sharding.offload_params"), std::string::npos) << msg;
  FsdpOptions dtypes;
  dtypes.sharding.mixed_precision.param_dtype = at::kBFloat16;
  const std::string msg2 = ErrorOf([&] { FsdpStrategy s(dtypes); });
  EXPECT_NE(msg2.find("not sharding.mixed_precision"), std::string::npos) << msg2;
}

// Every spelling of CPU offload becomes the core's offload_params when the
// model computes on a CUDA device, and stays off on CPU (no CUDA model needed:
// ResolvedShardingOptions is what WrapModel hands to the core).
TEST(Offload, EverySpellingTurnsOnOffloadParamsOnCudaOnly) {
  const std::vector<std::pair<std::string, StrategyOptions>> spellings = {
      {"fsdp_native", {{"cpu_offload", "true"}}},
      {"fsdp_native", {{"offload_params", "true"}}},
      {"fsdp_native_full_shard_offload", {}},
      {"fsdp", {{"mixed_precision", "true"}, {"cpu_offload", "true"}}},
      {"fsdp", {{"move_grads_to_cpu", "true"}}},
      {"ddp_fully_sharded", {{"mixed_precision", "true"}, {"cpu_offload", "true"}}},
  };
  for (const auto& [name, opts] : spellings) {
    SCOPED_TRACE(name + " " + (opts.empty() ? "" : opts.rbegin()->first));
    auto s = StrategyRegistry::Create(name, opts);
    auto& sharded = dynamic_cast<ShardedStrategyBase&>(*s);
    EXPECT_FALSE(sharded.ResolvedShardingOptions().offload_params) << "CPU is the default device";
    s->SetDevice(c10::Device(c10::kCUDA, 1));
    EXPECT_TRUE(sharded.ResolvedShardingOptions().offload_params);
    s->SetDevice(c10::Device(c10::kCPU));
    EXPECT_FALSE(sharded.ResolvedShardingOptions().offload_params);
  }
  // Without an offload option it stays off on CUDA too.
  for (const std::string name : {"fsdp", "fsdp_native"}) {
    auto s = StrategyRegistry::Create(name);
    s->SetDevice(c10::Device(c10::kCUDA, 0));
    EXPECT_FALSE(dynamic_cast<ShardedStrategyBase&>(*s).ResolvedShardingOptions().offload_params) << name;
  }
  // On CPU, WrapModel hands the core offload_params=false.
  RunRanks(2, [](int, const auto& comm) {
    auto s = StrategyRegistry::Create("fsdp_native_full_shard_offload");
    s->Setup(comm, {});
    s->WrapModel(shardtrain::testing::MlpWithBatchNorm().make());
    EXPECT_FALSE(dynamic_cast<ShardedStrategyBase&>(*s).sharding_options().offload_params);
  });
}

// Checkpoint state goes through the Strategy interface: a sharded strategy's
// pieces fit its own model and a renamed parameter is named as missing and
// unexpected; replicated strategies have no sharded state and say so.
TEST(CheckpointState, ShardedPiecesThroughTheStrategyInterface) {
  std::mutex mu;
  std::vector<sharding::ShardedStateDict> pieces(2);
  RunRanks(2, [&](int rank, const auto& comm) {
    auto s = StrategyRegistry::Create("fsdp_native");
    s->Setup(comm, {});
    s->WrapModel(shardtrain::testing::MlpWithBatchNorm().make());
    ASSERT_TRUE(s->has_sharded_state());
    {
      std::lock_guard<std::mutex> lock(mu);
      pieces[rank] = s->ShardedState();
    }
    s->Barrier();
    EXPECT_TRUE(s->CheckShardedState(pieces).empty());
    auto renamed = pieces;
    const std::string name = renamed[0].units[0].param_names[0];
    for (auto& p : renamed) p.units[0].param_names[0] = "renamed";
    std::string all;
    for (const auto& line : s->CheckShardedState(renamed)) all += line + "\n";
    EXPECT_NE(all.find("missing: '" + name + "'"), std::string::npos) << all;
    EXPECT_NE(all.find("unexpected: 'renamed'"), std::string::npos) << all;
    s->Barrier();
  });
  for (const std::string name : {"single_device", "ddp"}) {
    auto s = StrategyRegistry::Create(name);
    EXPECT_FALSE(s->has_sharded_state());
    const std::string msg = ErrorOf([&] { s->ShardedState(); });
    EXPECT_NE(msg.find("strategy '" + name + "' is not sharded"), std::string::npos) << msg;
  }
}

// Sharded strategies keep float32 master shards, so Lightning's bf16-true
// (weights themselves in bfloat16) is refused with what to use instead;
// replicated strategies keep it.
TEST(Precision, ShardedStrategiesRejectBf16TrueAndNameBf16Mixed) {
  for (const std::string name : {"fsdp", "ddp_fully_sharded", "fsdp_native", "fsdp_native_full_shard_offload"}) {
    SCOPED_TRACE(name);
    auto s = StrategyRegistry::Create(name);
    const std::string msg = ErrorOf([&] { s->SetPrecision("bf16-true"); });
    EXPECT_NE(msg.find("strategy '" + name + "': precision 'bf16-true' would keep the parameters themselves"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("no float32 master copy"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Use precision 'bf16-mixed'"), std::string::npos) << msg;
    EXPECT_EQ(s->precision(), "32-true");
    s->SetPrecision("bf16-mixed");
    EXPECT_EQ(s->precision(), "bf16-mixed");
  }
  for (const std::string name : {"ddp", "single_device"}) {
    auto s = StrategyRegistry::Create(name);
    s->SetPrecision("bf16-true");
    EXPECT_EQ(s->precision(), "bf16-true") << name;
  }
}

// fsdp's default wrap policy makes every Sharded<> wrap point a unit, as
// fsdp_native's default does: the tiny GPT (3 blocks) is 4 units, not 1.
TEST(WrapPolicy, FsdpDefaultShardsEveryWrapPoint) {
  auto tm = shardtrain::testing::TinyGpt();
  std::map<std::string, int> units;
  std::mutex mu;
  RunRanks(2, [&](int rank, const auto& comm) {
    for (const std::string name : {"fsdp", "fsdp_native"}) {
      auto s = StrategyRegistry::Create(name);
      s->Setup(comm, {});
      s->WrapModel(tm.make());
      const int n = dynamic_cast<ShardedStrategyBase&>(*s).sharded_model().num_units();
      std::lock_guard<std::mutex> lock(mu);
      if (rank == 0) units[name] = n;
    }
  });
  EXPECT_GT(units["fsdp"], 1);
  EXPECT_EQ(units["fsdp"], 4);  // 3 blocks + the root
  EXPECT_EQ(units["fsdp"], units["fsdp_native"]);
  EXPECT_EQ(FsdpOptions{}.min_num_params, 0);
  // min_num_params still merges small wrap points into their parent.
  RunRanks(2, [&](int rank, const auto& comm) {
    auto s = StrategyRegistry::Create("fsdp", {{"min_num_params", "100000000"}});
    s->Setup(comm, {});
    s->WrapModel(tm.make());
    if (rank == 0) {  // braces: EXPECT_EQ is an if/else inside (-Wdangling-else)
      EXPECT_EQ(dynamic_cast<ShardedStrategyBase&>(*s).sharded_model().num_units(), 1);
    }
  });
}

// ---------------------------------------------------------------------------
// Parity

constexpr int kSteps = 6;
constexpr int kMicro = 2;  // micro-batches per step (gradient accumulation)
constexpr int64_t kGlobalBatch = 8;
constexpr double kClip = 0.5;

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> state;
};

// Each rank takes its slice of each micro-batch; the first micro-batch
// backward does not sync; gradients are clipped by norm, then Adam steps.
RunResult Train(const std::string& name, const StrategyOptions& opts, int world, bool clip = true, int micro = kMicro) {
  auto tm = shardtrain::testing::MlpWithBatchNorm();
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(tm.make());
  RunResult result;
  std::mutex mu;
  RunRanks(world, [&](int rank, const auto& comm) {
    auto s = StrategyRegistry::Create(name, opts);
    ClusterInfo cluster;
    s->Setup(world == 1 && name == "single_device" ? nullptr : comm::CommunicatorPtr(comm), cluster);
    s->WrapModel(models[rank]);
    s->module().train();
    torch::optim::Adam opt(s->parameters(), torch::optim::AdamOptions(1e-2));
    const int64_t per = kGlobalBatch / micro / world;
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      double total = 0;
      for (int m = 0; m < micro; ++m) {
        auto [x, y] = tm.data(m, kGlobalBatch / micro);  // the same two micro-batches: loss must fall
        x = x.slice(0, rank * per, (rank + 1) * per);
        y = y.slice(0, rank * per, (rank + 1) * per);
        at::Tensor out = s->Forward([&] { return tm.forward(s->module(), x); });
        at::Tensor loss = tm.loss(out, y);
        s->Backward(loss / micro, /*sync_gradients=*/m == micro - 1);
        total += s->ReduceMean(loss.item<double>()) / micro;
      }
      if (clip) s->ClipGradients(kClip, GradClipAlgorithm::kNorm);
      opt.step();
      opt.zero_grad();
      losses.push_back(total);
    }
    auto state = s->FullStateDict();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result.losses = losses;
      result.state = state;
    }
  });
  return result;
}

void ExpectSame(const RunResult& ref, const RunResult& got, double tol) {
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], tol) << "step " << i;
  for (const auto& [k, v] : ref.state) {
    if (k.find("running") != std::string::npos || k.find("num_batches") != std::string::npos) continue;
    auto it = got.state.find(k);
    ASSERT_NE(it, got.state.end()) << k;
    EXPECT_LE((it->second - v).abs().max().item<double>(), tol) << k;
  }
}

TEST(Parity, EveryStrategyMatchesDdp) {
  // Reference: one process on the global batch (each micro-batch in two halves,
  // as the ranks see it, so BatchNorm statistics match).
  RunResult ddp = Train("ddp", {{"bucket_cap_mb", "0.001"}}, 2);  // several buckets
  EXPECT_LT(ddp.losses.back(), ddp.losses.front());
  struct Case {
    std::string name;
    StrategyOptions opts;
  };
  std::vector<Case> cases = {
      {"fsdp_native", {}},
      {"fsdp_native", {{"sharding_strategy", "SHARD_GRAD_OP"}, {"backward_prefetch", "BACKWARD_POST"}}},
      {"fsdp_native", {{"sharding_strategy", "NO_SHARD"}}},
      {"fsdp_native", {{"auto_wrap_policy", "type:MlpBlockImpl"}, {"limit_all_gathers", "false"}}},
      {"fsdp_native_full_shard_offload", {{"forward_prefetch", "true"}}},
      {"fsdp", {}},  // min_num_params 0 (the default): every wrap point is a unit
      {"fsdp", {{"min_num_params", "100"}, {"reshard_after_forward", "false"}}},
      {"ddp_fully_sharded", {{"min_num_params", "1"}}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    RunResult got = Train(c.name, c.opts, 2);
    ExpectSame(ddp, got, 1e-5);
    EXPECT_LT(got.losses.back(), got.losses.front());
  }
}

TEST(Parity, UseOrigParamsMatchesDdpWithoutAccumulation) {
  RunResult ddp = Train("ddp", {}, 2, /*clip=*/true, /*micro=*/1);
  RunResult got = Train("fsdp_native", {{"use_orig_params", "true"}, {"auto_wrap_policy", "never"}}, 2, true, 1);
  ExpectSame(ddp, got, 1e-5);
  got = Train("fsdp_native", {{"use_orig_params", "true"}}, 2, true, 1);
  ExpectSame(ddp, got, 1e-5);
}

// use_orig_params with accumulation: the first micro-batch's backward runs
// without sync (the core's no_sync), the second reduces the sum; weights and
// losses equal DDP accumulating the same micro-batches (no_sync, then one
// all-reduce), clipped alike.
TEST(Parity, UseOrigParamsAccumulatesLikeDdp) {
  RunResult ddp = Train("ddp", {}, 2, /*clip=*/true, /*micro=*/2);
  for (const char* policy : {"never", "always"}) {
    SCOPED_TRACE(policy);
    RunResult got = Train("fsdp_native", {{"use_orig_params", "true"}, {"auto_wrap_policy", policy}}, 2, true, 2);
    ExpectSame(ddp, got, 1e-5);
  }
}

// fsdp's gradient_predivide_factor and gradient_postdivide_factor reach the
// reduce-scatter: the reduced gradient is the sum over ranks divided by both,
// so factors whose product is not the world size scale it (the default splits
// W = 2 between them: the mean).
TEST(Fsdp, GradientDivideFactorsScaleTheReducedGradient) {
  auto tm = shardtrain::testing::MlpWithBatchNorm();
  auto grads = [&](const StrategyOptions& opts) {
    std::vector<std::shared_ptr<torch::nn::Module>> models{tm.make(), tm.make()};
    std::vector<at::Tensor> out;
    std::mutex mu;
    RunRanks(2, [&](int rank, const auto& comm) {
      auto s = StrategyRegistry::Create("fsdp", opts);
      s->Setup(comm, {});
      s->WrapModel(models[rank]);
      auto [x, y] = tm.data(0, 8);
      s->Backward(tm.loss(s->Forward([&] { return tm.forward(s->module(), x.slice(0, rank * 4, rank * 4 + 4)); }),
                          y.slice(0, rank * 4, rank * 4 + 4)));
      if (rank != 0) return;
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& p : s->parameters()) out.push_back(p.grad().clone());
    });
    return out;
  };
  const auto mean = grads({});
  ASSERT_FALSE(mean.empty());
  const std::vector<std::pair<StrategyOptions, double>> cases = {
      {{{"gradient_predivide_factor", "1"}, {"gradient_postdivide_factor", "1"}}, 2.0},  // the sum
      {{{"gradient_predivide_factor", "4"}, {"gradient_postdivide_factor", "1"}}, 0.5},
      {{{"gradient_predivide_factor", "1"}, {"gradient_postdivide_factor", "4"}}, 0.5},
      {{{"gradient_predivide_factor", "2"}}, 1.0},  // the post factor defaults to W / pre
  };
  for (const auto& [opts, scale] : cases) {
    const auto got = grads(opts);
    ASSERT_EQ(got.size(), mean.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::allclose(got[i], mean[i] * scale, 1e-5, 1e-7))
          << opts.begin()->first << "=" << opts.begin()->second << " (x" << scale << "): parameter " << i;
    }
  }
}

TEST(Parity, SingleDeviceLearns) {
  // single_device at W=1 sees the whole micro-batch at once (BatchNorm over 4
  // samples instead of 2), so it is not bit-comparable; it must learn.
  RunResult r = Train("single_device", {}, 1);
  EXPECT_LT(r.losses.back(), r.losses.front());
}

// DDP: gradients are averaged by bucket all-reduces launched from the
// gradient hooks while backward still runs, and equal the mean of what each
// rank computes alone.
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


// ---------------------------------------------------------------------------
// Frozen and tied parameters through every strategy

// Two wrap points sharing one weight ("b0.shared" and "b1.shared" are one
// tensor), a frozen layer inside b0's unit and a frozen bias at the root.
class TieBlockImpl : public torch::nn::Module {
 public:
  TieBlockImpl(const at::Tensor& shared_weight, bool with_frozen) {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    shared = register_parameter("shared", shared_weight);
    if (with_frozen) {
      aux = register_module("aux", torch::nn::Linear(8, 8));
      for (auto& p : aux->parameters()) p.set_requires_grad(false);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = fc->forward(x) + at::matmul(x, shared);
    return at::tanh(aux ? y + aux->forward(x) : y);
  }
  torch::nn::Linear fc{nullptr}, aux{nullptr};
  at::Tensor shared;
};

class FrozenTiedNetImpl : public torch::nn::Module {
 public:
  FrozenTiedNetImpl() {
    at::manual_seed(5);
    at::Tensor w = at::randn({8, 8}) * 0.3;
    b0 = register_module("b0", std::make_shared<sharding::Sharded<TieBlockImpl>>(w, true));
    b1 = register_module("b1", std::make_shared<sharding::Sharded<TieBlockImpl>>(w, false));
    head = register_module("head", torch::nn::Linear(8, 1));
    head->bias.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(b1->forward(b0->forward(x))); }
  std::shared_ptr<sharding::Sharded<TieBlockImpl>> b0, b1;
  torch::nn::Linear head{nullptr};
};

const char* const kFrozenNames[] = {"b0.aux.weight", "b0.aux.bias", "head.bias"};

at::Tensor TieBatch(int step) { return at::randn({8, 8}, at::detail::createCPUGenerator(77 + step)); }

// AdamW with decoupled weight decay: frozen weights must not decay.
RunResult TrainFrozenTied(const std::string& name, const StrategyOptions& opts, int world) {
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(std::make_shared<FrozenTiedNetImpl>());
  RunResult result;
  std::mutex mu;
  RunRanks(world, [&](int rank, const auto& comm) {
    auto s = StrategyRegistry::Create(name, opts);
    s->Setup(name == "single_device" ? nullptr : comm::CommunicatorPtr(comm), ClusterInfo{});
    s->WrapModel(models[rank]);
    torch::optim::AdamW opt(s->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto* net = dynamic_cast<FrozenTiedNetImpl*>(&s->module());
    std::vector<double> losses;
    for (int step = 0; step < 5; ++step) {
      at::Tensor x = TieBatch(step).slice(0, rank * 8 / world, (rank + 1) * 8 / world);
      at::Tensor loss = s->Forward([&] { return net->forward(x); }).pow(2).mean();
      s->Backward(loss);
      opt.step();
      opt.zero_grad();
      losses.push_back(s->ReduceMean(loss.item<double>()));
    }
    auto state = s->FullStateDict();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result.losses = losses;
      result.state = state;
    }
  });
  return result;
}

TEST(Parity, FrozenAndTiedParametersThroughEveryStrategy) {
  std::map<std::string, at::Tensor> initial;
  {
    FrozenTiedNetImpl net;
    for (const auto& item : net.named_parameters()) initial[item.key()] = item.value().detach().clone();
  }
  // Plain training, each tensor stepped once (LibTorch lists a tied weight under both names).
  RunResult plain;
  {
    FrozenTiedNetImpl net;
    std::vector<at::Tensor> params;
    std::set<const void*> seen;
    for (auto& p : net.parameters()) {
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
    }
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int step = 0; step < 5; ++step) {
      at::Tensor loss = net.forward(TieBatch(step)).pow(2).mean();
      loss.backward();
      opt.step();
      opt.zero_grad();
      plain.losses.push_back(loss.item<double>());
    }
    for (const auto& item : net.named_parameters()) plain.state[item.key()] = item.value().detach().clone();
  }
  for (const char* n : kFrozenNames) ASSERT_TRUE(at::equal(plain.state.at(n), initial.at(n))) << n;
  struct Case {
    std::string name;
    StrategyOptions opts;
    int world;
  };
  const std::vector<Case> cases = {
      {"single_device", {}, 1},
      {"ddp", {}, 2},
      {"fsdp_native", {}, 2},
      {"fsdp_native", {{"sharding_strategy", "SHARD_GRAD_OP"}}, 2},
      {"fsdp_native", {{"use_orig_params", "true"}}, 2},
      {"fsdp", {{"min_num_params", "1"}}, 2},
      {"fsdp", {}, 1},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name + " W=" + std::to_string(c.world));
    RunResult got = TrainFrozenTied(c.name, c.opts, c.world);
    EXPECT_EQ(got.state.size(), plain.state.size()) << "every name of every parameter";
    ExpectSame(plain, got, 1e-5);
    for (const char* n : kFrozenNames) EXPECT_TRUE(at::equal(got.state.at(n), initial.at(n))) << "frozen " << n;
    EXPECT_TRUE(at::equal(got.state.at("b0.shared"), got.state.at("b1.shared")));
  }
}

}  // namespace
}  // namespace shardtrain::strategies
