// Sharded checkpoints (fsdp_native state_dict_type=sharded) end to end on CPU,
// threads-as-ranks over Gloo: layout, resume at the same and other world sizes
// (model and optimizer resharded), full checkpoints resumed at another world
// size or strategy, and the error paths (missing or truncated shard file,
// unfinished save, another model), each leaving the model untouched.
#include <gtest/gtest.h>
#include <torch/optim/optimizer.h>

#include <fstream>
#include <iterator>
#include <set>

#include "base/errors.h"
#include "tests/trainer/fixtures.h"
#include "trainer/checkpoint_io/checkpoint.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;

TrainerOptions Sharded(const std::string& root, int world, strategies::StrategyOptions extra = {}) {
  TrainerOptions o = BaseOptions(root, world);
  o.strategy = "fsdp_native";
  o.strategy_options = {{"state_dict_type", "sharded"}};
  for (const auto& [k, v] : extra) o.strategy_options[k] = v;
  return o;
}

void ExpectContinues(const std::vector<double>& resumed, const std::vector<double>& full, size_t from, double tol) {
  ASSERT_EQ(resumed.size() + from, full.size());
  for (size_t i = 0; i < resumed.size(); ++i) EXPECT_NEAR(resumed[i], full[from + i], tol) << "step " << from + i;
}

// W=2 uninterrupted vs W=2 stopped after 6 of 12 steps (sharded last.ckpt) and
// resumed at W=1, 2 and 4 with the same global batch.
void ResumeAtOtherWorldSizes(const std::string& optimizer, strategies::StrategyOptions extra,
                             std::vector<int> worlds) {
  ClassifierConfig c;
  c.optimizer = optimizer;
  const std::string tag = optimizer + (extra.empty() ? "" : "_orig");
  FitResult full = Fit(2, Sharded(TmpDir("full_" + tag), 2, extra), "", c);
  ASSERT_EQ(full.losses.size(), 12u);
  TrainerOptions first = Sharded(TmpDir("first_" + tag), 2, extra);
  first.max_steps = 6;  // stops in the middle of epoch 1
  FitResult a = Fit(2, first, "", c);
  ASSERT_EQ(a.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(a.losses[i], full.losses[i]);
  ASSERT_TRUE(fs::is_directory(a.last_ckpt)) << a.last_ckpt;
  for (const char* f : {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"}) {
    EXPECT_TRUE(fs::exists(fs::path(a.last_ckpt) / f)) << f;
  }
  for (int w : worlds) {
    SCOPED_TRACE("resumed at W=" + std::to_string(w));
    FitResult b = Fit(w, Sharded(TmpDir("resume_" + tag + std::to_string(w)), w, extra), a.last_ckpt, c);
    ExpectContinues(b.losses, full.losses, 6, 1e-5);
    EXPECT_EQ(b.global_step, 12);
  }
}

TEST(ShardedCheckpoint, AdamResumesAtWorldSizes1_2_4) { ResumeAtOtherWorldSizes("adam", {}, {1, 2, 4}); }

TEST(ShardedCheckpoint, SgdMomentumAndAdamWReshard) {
  ResumeAtOtherWorldSizes("sgd", {}, {1, 4});
  ResumeAtOtherWorldSizes("adamw", {}, {4});
}

TEST(ShardedCheckpoint, UseOrigParamsReshards) {
  ResumeAtOtherWorldSizes("adamw", {{"use_orig_params", "true"}}, {1, 4});
}

// Saved with every wrap point a unit (W=2), loaded into one root unit (W=4,
// auto_wrap_policy=never): each rank takes its ranges parameter by parameter
// from the saved units. The state is exactly the saved one, and training
// continues like the uninterrupted run.
TEST(ShardedCheckpoint, LoadsIntoAnotherWrapping) {
  FitResult full = Fit(2, Sharded(TmpDir("wrap_full"), 2));
  TrainerOptions first = Sharded(TmpDir("wrap_a"), 2);
  first.max_steps = 6;
  FitResult a = Fit(2, first);
  TrainerOptions load = Sharded(TmpDir("wrap_b"), 4, {{"auto_wrap_policy", "never"}});
  load.max_steps = 6;  // loads, then stops
  const std::string again = (fs::path(TmpDir("wrap_again")) / "ckpt").string();
  Fit(4, load, a.last_ckpt, {}, [&](int, Trainer& t, Classifier&) { t.SaveCheckpoint(again, CheckpointFormat::kSharded); });
  const DcpCheckpoint db = OpenDcpCheckpoint(a.last_ckpt), da = OpenDcpCheckpoint(again);
  // 3 units over 2 ranks, then one unit over 4: other chunks of the same parameter.
  EXPECT_NE(db.reader->metadata().tensors.at("model.b2.fc.weight").chunks.size(),
            da.reader->metadata().tensors.at("model.b2.fc.weight").chunks.size());
  const CheckpointData before = ConsolidateDcpCheckpoint(db), after = ConsolidateDcpCheckpoint(da);
  const auto &pb = before.state_dict, &pa = after.state_dict;
  ASSERT_EQ(pb.size(), pa.size());
  for (const auto& [k, v] : pb) EXPECT_TRUE(v.equal(pa.at(k))) << k;
  const auto &ob = before.optimizer_full, &oa = after.optimizer_full;
  EXPECT_EQ(ob.kind, "Adam");
  EXPECT_EQ(ob.step, oa.step);
  ASSERT_EQ(ob.state.size(), pb.size());
  for (const auto& [name, keys] : ob.state) {
    for (const auto& [k, v] : keys) EXPECT_TRUE(v.equal(oa.state.at(name).at(k))) << name << " " << k;
  }
  FitResult b = Fit(4, Sharded(TmpDir("wrap_c"), 4, {{"auto_wrap_policy", "never"}}), a.last_ckpt);
  ExpectContinues(b.losses, full.losses, 6, 1e-5);
}

// With use_orig_params at W=4 some ranks hold no element of the small
// parameters (head.bias has 3): the full checkpoint's optimizer order still
// names every parameter once, in the module's order (the ranks agree on it).
TEST(ShardedCheckpoint, UseOrigParamsFullCheckpointNamesEveryParameterInOrder) {
  TrainerOptions o = Sharded(TmpDir("orig_names"), 4, {{"use_orig_params", "true"}});
  o.max_steps = 2;
  const std::string path = (fs::path(TmpDir("orig_names")) / "full.ckpt").string();
  Fit(4, o, "", {}, [&](int, Trainer& t, fixtures::Classifier&) { t.SaveCheckpoint(path, CheckpointFormat::kFull); });
  CheckpointData d = LoadCheckpoint(path);
  const std::vector<std::string> names = {"b1.fc.weight", "b1.fc.bias", "b2.fc.weight",
                                          "b2.fc.bias",   "head.weight", "head.bias"};
  ASSERT_EQ(d.optimizer_groups.size(), 1u);
  EXPECT_EQ(d.optimizer_groups[0].params, names);
  EXPECT_EQ(d.optimizer_full.state.size(), names.size());
  EXPECT_EQ(d.optimizer_full.state.at("head.bias").at("exp_avg").numel(), 3);
}

TEST(ShardedCheckpoint, FullCheckpointResumesAtOtherWorldSizeAndStrategy) {
  // Full checkpoints carry the optimizer state by parameter name as well.
  FitResult full = Fit(2, [] {
    TrainerOptions o = BaseOptions(TmpDir("fullck_full"), 2);
    o.strategy = "ddp";
    return o;
  }());
  TrainerOptions first = BaseOptions(TmpDir("fullck_a"), 2);
  first.strategy = "ddp";
  first.max_steps = 6;
  FitResult a = Fit(2, first);
  ASSERT_TRUE(fs::is_regular_file(a.last_ckpt));
  CheckpointData d = LoadCheckpoint(a.last_ckpt);
  EXPECT_EQ(d.optimizer_full.kind, "Adam");
  EXPECT_EQ(d.optimizer_full.state.at("b1.fc.weight").at("exp_avg").sizes(), (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(d.optimizer_full.step.at("head.bias"), 6);
  // ddp at W=2 -> fsdp_native at W=4, and ddp at W=1.
  TrainerOptions b4 = BaseOptions(TmpDir("fullck_b4"), 4);
  b4.strategy = "fsdp_native";
  ExpectContinues(Fit(4, b4, a.last_ckpt).losses, full.losses, 6, 1e-5);
  TrainerOptions b1 = BaseOptions(TmpDir("fullck_b1"), 1);
  b1.strategy = "ddp";
  ExpectContinues(Fit(1, b1, a.last_ckpt).losses, full.losses, 6, 1e-5);
}

TEST(ShardedCheckpoint, ConsolidatedCheckpointResumesAtOtherWorldSize) {
  FitResult full = Fit(2, Sharded(TmpDir("cons_full"), 2));
  TrainerOptions first = Sharded(TmpDir("cons_a"), 2);
  first.max_steps = 6;
  FitResult a = Fit(2, first);
  const std::string out = (fs::path(TmpDir("cons_out")) / "full.ckpt").string();
  SaveCheckpoint(out, ConsolidateDcpCheckpoint(OpenDcpCheckpoint(a.last_ckpt)));
  CheckpointData d = LoadCheckpoint(out);
  EXPECT_EQ(d.global_step, 6);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.strategy, "fsdp_native");
  EXPECT_EQ(d.state_dict.at("head.weight").sizes(), (std::vector<int64_t>{3, 16}));
  // Resume from the consolidated file: sharded at W=4 (full format, resharded optimizer).
  TrainerOptions b = Sharded(TmpDir("cons_b"), 4);
  b.strategy_options = {};  // state_dict_type=full: writes full checkpoints
  ExpectContinues(Fit(4, b, out).losses, full.losses, 6, 1e-5);
}

// HYBRID_SHARD (W=4: shard groups {0,1}, {2,3}) and NO_SHARD replicas hold
// equal shards: only the first replica writes chunks (DCP keeps one copy),
// and the checkpoint resumes FULL_SHARD at W=2 like the uninterrupted run.
TEST(ShardedCheckpoint, ReplicasWriteTheirShardsOnce) {
  for (const char* strategy : {"HYBRID_SHARD", "NO_SHARD"}) {
    SCOPED_TRACE(strategy);
    const strategies::StrategyOptions replicated = {
        {"sharding_strategy", strategy},
        {"hybrid_shard_group_size", std::string(strategy) == "HYBRID_SHARD" ? "2" : "0"}};
    const std::string tag = strategy;
    FitResult full = Fit(4, Sharded(TmpDir("repl_full" + tag), 4, replicated));
    TrainerOptions first = Sharded(TmpDir("repl_a" + tag), 4, replicated);
    first.max_steps = 6;
    FitResult a = Fit(4, first);
    const dcp::Reader r(a.last_ckpt);
    std::set<std::string> files;
    for (const auto& [key, e] : r.metadata().tensors) {
      int64_t n = 0;
      for (const auto& c : e.chunks) {
        files.insert(c.where.file);
        n += c.box.numel();
      }
      EXPECT_EQ(n, c10::multiply_integers(e.shape)) << key << ": written more than once, or not at all";
    }
    const std::set<std::string> writers = std::string(strategy) == "HYBRID_SHARD"
                                              ? std::set<std::string>{"__0_0.distcp", "__1_0.distcp"}
                                              : std::set<std::string>{"__0_0.distcp"};
    EXPECT_EQ(files, writers);
    ExpectContinues(Fit(2, Sharded(TmpDir("repl_b" + tag), 2), a.last_ckpt).losses, full.losses, 6, 1e-5);
  }
}

// Optimizers other than Adam, AdamW and SGD keep their LibTorch archive per
// rank: the checkpoint resumes at the same world size and stops with a
// message at another.
TEST(ShardedCheckpoint, OtherOptimizersResumeAtTheSameWorldSizeOnly) {
  ClassifierConfig c;
  c.optimizer = "rmsprop";
  FitResult full = Fit(2, Sharded(TmpDir("rms_full"), 2), "", c);
  TrainerOptions first = Sharded(TmpDir("rms_a"), 2);
  first.max_steps = 6;
  FitResult a = Fit(2, first, "", c);
  ExpectContinues(Fit(2, Sharded(TmpDir("rms_b"), 2), a.last_ckpt, c).losses, full.losses, 6, 1e-5);
  auto train = MakeData(64, 1);
  shardtrain::testing::RunRanks(4, [&](int rank, const auto& comm) {
    Classifier module(c);
    Trainer trainer(Sharded(TmpDir("rms_fail" + std::to_string(rank)), 4), comm);
    try {
      trainer.Fit(module, *train, nullptr, a.last_ckpt);
      ADD_FAILURE() << "loading at W=4 did not fail";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("only Adam, AdamW and SGD state loads at another world size"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(trainer.global_step(), 0);
  });
}

// A weight tied across two wrap points (registered in both: "a.w" and "b.w"
// are one tensor) and a frozen vector.
class TiedLayerImpl : public torch::nn::Module {
 public:
  TiedLayerImpl(const at::Tensor& w, at::Generator* g) {
    this->w = register_parameter("w", w);
    bias = register_parameter("bias", at::randn({8}, *g) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(at::linear(x, w, bias)); }
  at::Tensor w, bias;
};
class TiedNetImpl : public torch::nn::Module {
 public:
  TiedNetImpl() {
    auto g = at::detail::createCPUGenerator(9);
    const at::Tensor w = at::randn({8, 8}, g) * 0.3;
    a = register_module("a", std::make_shared<sharding::Sharded<TiedLayerImpl>>(w, &g));
    b = register_module("b", std::make_shared<sharding::Sharded<TiedLayerImpl>>(w, &g));
    head = register_parameter("head", at::randn({3, 8}, g) * 0.3);
    scale = register_parameter("scale", at::linspace(0.5, 1.5, 8), /*requires_grad=*/false);
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(b->forward(a->forward(x * scale)), head); }
  std::shared_ptr<sharding::Sharded<TiedLayerImpl>> a, b;
  at::Tensor head, scale;
};
class TiedModule : public TrainingModule {
 public:
  std::shared_ptr<torch::nn::Module> configure_model() override { return net_ = std::make_shared<TiedNetImpl>(); }
  at::Tensor training_step(const Batch& batch, int64_t) override {
    return at::cross_entropy_loss(forward([&] { return net_->forward(batch.inputs); }), batch.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    return {std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2))};
  }
  std::shared_ptr<TiedNetImpl> net_;
};

// Tied and frozen parameters: the tied weight is in the directory under both
// names (the same bytes), the frozen one without optimizer state, and the
// checkpoint resumes at W=4 like the uninterrupted run.
TEST(ShardedCheckpoint, TiedAndFrozenParameters) {
  auto data = MakeData(64, 1);
  auto run = [&](int world, const std::string& root, int64_t max_steps, const std::string& ckpt) {
    TrainerOptions o = Sharded(TmpDir(root), world);
    o.max_steps = max_steps;
    std::vector<double> losses;
    std::string last;
    shardtrain::testing::RunRanks(world, [&](int rank, const auto& comm) {
      TiedModule module;
      Trainer trainer(o, comm);
      trainer.Fit(module, *data, nullptr, ckpt);
      if (rank == 0) {
        losses = trainer.step_losses();
        last = trainer.last_checkpoint_path();
      }
    });
    return std::make_pair(losses, last);
  };
  const auto full = run(2, "tied_full", 12, "");
  const auto a = run(2, "tied_a", 6, "");
  const dcp::Reader r(a.second);
  const auto& md = r.metadata();
  ASSERT_TRUE(md.tensors.count("model.a.w") && md.tensors.count("model.b.w"));
  const auto &ca = md.tensors.at("model.a.w").chunks, &cb = md.tensors.at("model.b.w").chunks;
  ASSERT_EQ(ca.size(), cb.size());
  for (size_t i = 0; i < ca.size(); ++i) {
    EXPECT_EQ(ca[i].where.file, cb[i].where.file);
    EXPECT_EQ(ca[i].where.offset, cb[i].where.offset);
  }
  EXPECT_TRUE(md.tensors.count("model.scale"));
  EXPECT_FALSE(md.tensors.count("optimizer_0.state.scale.exp_avg"));
  EXPECT_TRUE(md.tensors.count("optimizer_0.state.head.exp_avg"));
  const CheckpointData d = ConsolidateDcpCheckpoint(OpenDcpCheckpoint(a.second));
  EXPECT_TRUE(d.state_dict.at("a.w").equal(d.state_dict.at("b.w")));
  EXPECT_TRUE(d.state_dict.at("scale").equal(at::linspace(0.5, 1.5, 8)));
  const auto b = run(4, "tied_b", 12, a.second);
  ExpectContinues(b.first, full.first, 6, 1e-5);
}

// The sharded format of earlier releases (metadata.pt, rank_<r>.pt) still
// resumes: the state of a DCP checkpoint rewritten in it, as one unit laid
// out over 2 shard ranks, continues like the uninterrupted run at W=4.
TEST(ShardedCheckpoint, EarlierFormatStillResumes) {
  FitResult full = Fit(2, Sharded(TmpDir("legacy_full"), 2));
  TrainerOptions first = Sharded(TmpDir("legacy_a"), 2);
  first.max_steps = 6;
  FitResult a = Fit(2, first);
  const CheckpointData d = ConsolidateDcpCheckpoint(OpenDcpCheckpoint(a.last_ckpt));
  ShardedCheckpoint legacy;
  legacy.meta = d;
  legacy.meta.state_dict.clear();
  legacy.meta.optimizer_full = FullOptimizerState();
  sharding::UnitInfo unit;
  std::vector<std::vector<int64_t>> shapes;
  std::map<std::string, std::vector<at::Tensor>> flat;  // "" (parameters) and each state key
  for (const auto& name : d.optimizer_groups.at(0).params) {  // the module's order
    const at::Tensor& p = d.state_dict.at(name);
    unit.param_names.push_back(name);
    shapes.push_back(p.sizes().vec());
    unit.numel += p.numel();
    flat[""].push_back(p.reshape({-1}));
    for (const auto& [k, t] : d.optimizer_full.state.at(name)) flat[k].push_back(t.reshape({-1}));
  }
  unit.shard_numel = (unit.numel + 1) / 2;
  unit.padded_numel = 2 * unit.shard_numel;
  for (int r = 0; r < 2; ++r) {
    ShardedPiece& piece = legacy.pieces.emplace_back();
    piece.rank = r;
    piece.world_size = 2;
    piece.state.shard_rank = r;
    piece.state.shard_world = 2;
    piece.state.units = {unit};
    piece.state.param_shapes = {shapes};
    auto shard = [&](const std::vector<at::Tensor>& parts) {
      at::Tensor all = at::constant_pad_nd(at::cat(parts), {0, unit.padded_numel - unit.numel});
      return all.narrow(0, r * unit.shard_numel, unit.shard_numel).clone();
    };
    piece.state.shards = {shard(flat.at(""))};
    piece.optimizer_kind = "Adam";
    piece.optimizer.units.emplace_back();
    for (const auto& [k, parts] : flat) {
      if (!k.empty()) piece.optimizer.units[0][k] = shard(parts);
    }
    piece.optimizer.steps = {d.optimizer_full.step.at("head.bias")};
  }
  const std::string path = (fs::path(TmpDir("legacy_dir")) / "step=6.ckpt").string();
  SaveShardedCheckpoint(path, legacy);
  ASSERT_TRUE(fs::exists(fs::path(path) / "rank_1.pt") && !IsDcpCheckpoint(path));
  FitResult b = Fit(4, Sharded(TmpDir("legacy_b"), 4), path);
  ExpectContinues(b.losses, full.losses, 6, 1e-5);
}

// Runs a W=2 fit that must fail to load `ckpt` and checks nothing changed.
void ExpectLoadFails(const std::string& ckpt, const std::vector<std::string>& needles, ClassifierConfig c = {}) {
  auto train = MakeData(64, 1);
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    Classifier module(c);
    Trainer trainer(Sharded(TmpDir("fail_" + std::to_string(rank)), 2), comm);
    try {
      trainer.Fit(module, *train, nullptr, ckpt);
      ADD_FAILURE() << "loading " << ckpt << " did not fail";
      return;
    } catch (const Error& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
    EXPECT_EQ(trainer.global_step(), 0);
    EXPECT_EQ(trainer.current_epoch(), 0);
    EXPECT_TRUE(trainer.optimizer()->state().empty());
    // The model still holds its initial weights.
    auto sd = trainer.strategy().FullStateDict();
    if (rank == 0) {
      Classifier fresh(c);
      auto net = fresh.configure_model();
      for (const auto& item : net->named_parameters()) {
        ASSERT_TRUE(sd.count(item.key())) << item.key();
        EXPECT_TRUE(sd.at(item.key()).equal(item.value())) << item.key() << " changed";
      }
    }
  });
}

TEST(ShardedCheckpoint, ErrorsNameTheFileAndChangeNothing) {
  TrainerOptions o = Sharded(TmpDir("err_src"), 2);
  o.max_steps = 5;
  FitResult a = Fit(2, o);
  auto copy = [&](const std::string& name) {
    const fs::path dst = fs::path(TmpDir("err_" + name)) / "ckpt";
    fs::copy(a.last_ckpt, dst, fs::copy_options::recursive);
    return dst;
  };
  {  // a missing rank file
    const fs::path d = copy("missing");
    fs::remove(d / "__1_0.distcp");
    ExpectLoadFails(d.string(), {"missing the file", (d / "__1_0.distcp").string()});
    try {
      OpenDcpCheckpoint(d.string());
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find((d / "__1_0.distcp").string()), std::string::npos) << e.what();
    }
  }
  {  // a truncated rank file
    const fs::path d = copy("truncated");
    const fs::path f = d / "__0_0.distcp";
    std::string bytes;
    {
      std::ifstream in(f, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    {
      std::ofstream out(f, std::ios::binary | std::ios::trunc);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
    }
    ExpectLoadFails(d.string(), {"(truncated?)", f.string()});
  }
  {  // a chunk whose bytes are corrupt (its archive does not parse): the end of its zip directory
    const fs::path d = copy("corrupt");
    const fs::path f = d / "__1_0.distcp";
    const dcp::Reader r(d.string());
    const dcp::Chunk& c = r.metadata().tensors.at("model.head.weight").chunks.back();
    ASSERT_EQ(c.where.file, "__1_0.distcp");
    std::fstream io(f, std::ios::binary | std::ios::in | std::ios::out);
    io.seekp(static_cast<std::streamoff>(c.where.offset + c.where.length - 22));
    io.write("XXXXXXXXXXXXXXXXXXXXXX", 22);
    io.close();
    ExpectLoadFails(d.string(), {"truncated or corrupt", f.string()});
  }
  {  // an unfinished save (no .metadata, written last)
    const fs::path d = copy("incomplete");
    fs::remove(d / ".metadata");
    ExpectLoadFails(d.string(), {"incomplete", (d / ".metadata").string()});
  }
  {  // another model (4 classes instead of 3)
    ClassifierConfig other;
    other.classes = 4;
    ExpectLoadFails(a.last_ckpt, {"does not match the model", "head.weight"}, other);
  }
  {  // a missing directory
    ExpectLoadFails(a.last_ckpt + ".nope", {"cannot open checkpoint", a.last_ckpt + ".nope"});
  }
}

TEST(ShardedCheckpoint, InterruptedSaveKeepsThePreviousCheckpoint) {
  TrainerOptions o = Sharded(TmpDir("atomic"), 2);
  o.max_steps = 2;
  FitResult a = Fit(2, o);
  EXPECT_EQ(OpenDcpCheckpoint(a.last_ckpt).meta.global_step, 2);
  // A crash mid-save leaves the temporary directory with some files; the
  // checkpoint at the path is untouched and still loads.
  const std::string tmp = ShardedTempDir(a.last_ckpt);
  fs::create_directories(tmp);
  std::ofstream(fs::path(tmp) / "__0_0.distcp") << "partial";
  EXPECT_EQ(OpenDcpCheckpoint(a.last_ckpt).meta.global_step, 2);
  // The next save replaces the checkpoint and clears the leftovers.
  o.max_steps = 3;
  Fit(2, o, a.last_ckpt, {}, [&](int, Trainer& t, Classifier&) { t.SaveCheckpoint(a.last_ckpt, CheckpointFormat::kSharded); });
  EXPECT_EQ(OpenDcpCheckpoint(a.last_ckpt).meta.global_step, 3);
  EXPECT_FALSE(fs::exists(tmp));
  for (const auto& e : fs::directory_iterator(fs::path(a.last_ckpt).parent_path())) {
    EXPECT_EQ(e.path().filename().string().find("tmp"), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace shardtrain::trainer
