// The registry and the option tables of every strategy: unknown names and
// options, invalid values and combinations, typed options, the generated option
// reference, CPU offload spellings, bf16-true refusal, fsdp's default wrap policy.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/strategies/strategy_fixture.h"

namespace shardtrain::strategies {
namespace {

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

}  // namespace
}  // namespace shardtrain::strategies
