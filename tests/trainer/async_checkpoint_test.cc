// Asynchronous sharded saves (TrainerOptions::async_checkpoint), threads-as-
// ranks over Gloo: the checkpoints equal the synchronous run's bit for bit
// while the writer is slowed so that the optimizer reaches every unit first
// (copy-on-write), training is unchanged (the optimizer steps unit by unit),
// a writer's failure stops Fit on every rank with the checkpoints before it
// intact, and ModelCheckpoint deletes what it evicts only once the new
// checkpoint is complete.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <set>

#include "base/errors.h"
#include "tests/trainer/fixtures.h"
#include "trainer/callbacks/model_checkpoint.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/internal/zip_writer.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;

// The writer waits this long before each unit while set (async_save.h).
class WriterDelay {
 public:
  explicit WriterDelay(int ms) { setenv("SHARDTRAIN_ASYNC_SAVE_UNIT_DELAY_MS", std::to_string(ms).c_str(), 1); }
  ~WriterDelay() { unsetenv("SHARDTRAIN_ASYNC_SAVE_UNIT_DELAY_MS"); }
};

TrainerOptions Options(const std::string& root, bool async, double max_extra = 1.0) {
  TrainerOptions o = BaseOptions(root, 2);
  o.strategy = "fsdp_native";
  o.strategy_options = {{"state_dict_type", "sharded"}};
  o.checkpoint_every_n_steps = 2;
  o.async_checkpoint = async;
  o.async_checkpoint_max_extra_memory = max_extra;
  return o;
}

// What a rank writes of the model and its two Adam moments: 3 x 4 bytes x
// (16x8+16 + 16x16+16 + 3x16+3 elements) / 2 ranks, padding aside.
constexpr int64_t kRankStateBytes = 3 * 4 * (144 + 272 + 51) / 2;

// Every tensor of the checkpoint (model and optimizer state) and its step.
void ExpectSameCheckpoint(const std::string& a, const std::string& b) {
  SCOPED_TRACE(a + " vs " + b);
  const CheckpointData x = ConsolidateDcpCheckpoint(OpenDcpCheckpoint(a));
  const CheckpointData y = ConsolidateDcpCheckpoint(OpenDcpCheckpoint(b));
  EXPECT_EQ(x.global_step, y.global_step);
  ASSERT_EQ(x.state_dict.size(), y.state_dict.size());
  for (const auto& [k, t] : x.state_dict) EXPECT_TRUE(t.equal(y.state_dict.at(k))) << k;
  ASSERT_EQ(x.optimizer_full.state.size(), y.optimizer_full.state.size());
  for (const auto& [name, keys] : x.optimizer_full.state) {
    for (const auto& [key, t] : keys)
      EXPECT_TRUE(t.equal(y.optimizer_full.state.at(name).at(key))) << name << "." << key;
  }
  EXPECT_EQ(x.optimizer_full.step, y.optimizer_full.step);
}

// Every record of every archive in the checkpoint's rank files holds the
// CRC-32 of its bytes (the background save computes them at the save, the
// writer takes them; torch.load does not check them, Python's zipfile does).
void ExpectRecordChecksums(const std::string& ckpt) {
  int records = 0;
  for (const auto& e : fs::directory_iterator(ckpt)) {
    if (e.path().extension() != ".distcp") continue;
    std::ifstream in(e.path(), std::ios::binary);
    const std::string b{std::istreambuf_iterator<char>(in), {}};
    auto u16 = [&](size_t o) {
      return static_cast<uint32_t>(static_cast<uint8_t>(b[o]) | static_cast<uint8_t>(b[o + 1]) << 8);
    };
    auto u32 = [&](size_t o) { return u16(o) | u16(o + 2) << 16; };
    for (size_t o = b.find("PK\x03\x04"); o != std::string::npos; o = b.find("PK\x03\x04", o)) {
      ASSERT_LE(o + 30, b.size());
      const size_t size = u32(o + 22), data = o + 30 + u16(o + 26) + u16(o + 28);  // no record here passes 4 GiB
      ASSERT_LE(data + size, b.size()) << e.path();
      EXPECT_EQ(u32(o + 14), Crc32(0, b.data() + data, size)) << e.path() << " record at " << o;
      ++records;
      o = data + size;
    }
  }
  EXPECT_GT(records, 10) << ckpt;
}

TEST(AsyncCheckpoint, EqualsTheSynchronousSavesWhileTheOptimizerOvertakesTheWriter) {
  const FitResult sync = Fit(2, Options(TmpDir("async_ref"), false));
  AsyncCheckpointStats stats;
  FitResult async;
  {
    WriterDelay slow(40);  // each unit: longer than a step of this model
    async = Fit(2, Options(TmpDir("async_on"), true), "", {}, [&](int rank, Trainer& t, Classifier&) {
      if (rank == 0) stats = t.async_checkpoint_stats();
    });
  }
  ASSERT_EQ(async.losses.size(), 12u);
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(async.losses[i], sync.losses[i]) << "step " << i + 1;
  for (int step : {2, 4, 6, 8, 10, 12}) {
    const std::string name = "step=" + std::to_string(step) + ".ckpt";
    ExpectSameCheckpoint((fs::path(sync.ckpt_dir) / name).string(), (fs::path(async.ckpt_dir) / name).string());
    ExpectRecordChecksums((fs::path(async.ckpt_dir) / name).string());
  }
  EXPECT_EQ(async.last_ckpt, (fs::path(async.ckpt_dir) / "last.ckpt").string());
  ExpectSameCheckpoint(sync.last_ckpt, async.last_ckpt);  // the end of Fit waited for it
  // The optimizer copied units aside (the writer was slower), each freed once written.
  EXPECT_GE(stats.saves, 6);
  EXPECT_GT(stats.units_copied, 0);
  EXPECT_LE(stats.units_copied, stats.units);
  // At most a rank's share of the model and its two Adam moments.
  EXPECT_GT(stats.peak_extra_bytes, 0);
  EXPECT_LE(stats.peak_extra_bytes, kRankStateBytes + 3 * 4 * 8);
  for (const auto& e : fs::directory_iterator(async.ckpt_dir)) {
    EXPECT_EQ(e.path().filename().string().find("tmp"), std::string::npos) << e.path();
  }
}

// The copies aside stay within async_checkpoint_max_extra_memory: at 0 the
// optimizer waits for the (slowed) writer and copies nothing; at 0.5 it
// copies the units that fit and waits for the rest. The checkpoints and the
// training are the synchronous run's either way.
TEST(AsyncCheckpoint, CopiesAsideStayWithinTheMemoryBudget) {
  const FitResult sync = Fit(2, Options(TmpDir("async_budget_ref"), false));
  WriterDelay slow(40);
  for (double max_extra : {0.0, 0.5}) {
    SCOPED_TRACE("async_checkpoint_max_extra_memory " + std::to_string(max_extra));
    AsyncCheckpointStats stats;
    const FitResult async =
        Fit(2, Options(TmpDir("async_budget_" + std::to_string(static_cast<int>(max_extra * 10))), true, max_extra), "",
            {}, [&](int rank, Trainer& t, Classifier&) {
              if (rank == 0) stats = t.async_checkpoint_stats();
            });
    ASSERT_EQ(async.losses.size(), sync.losses.size());
    for (size_t i = 0; i < sync.losses.size(); ++i) EXPECT_EQ(async.losses[i], sync.losses[i]) << "step " << i + 1;
    for (int step : {2, 6, 12}) {
      const std::string name = "step=" + std::to_string(step) + ".ckpt";
      ExpectSameCheckpoint((fs::path(sync.ckpt_dir) / name).string(), (fs::path(async.ckpt_dir) / name).string());
    }
    EXPECT_GE(stats.saves, 6);
    EXPECT_GT(stats.wait_seconds, 0.0) << "the optimizer waited for the writer";
    // The budget is the fraction of what the rank writes (padding and the
    // optimizer's step aside).
    EXPECT_GE(stats.budget_bytes, static_cast<int64_t>(max_extra * kRankStateBytes));
    EXPECT_LE(stats.budget_bytes, static_cast<int64_t>(max_extra * (kRankStateBytes + 3 * 4 * 8)));
    EXPECT_LE(stats.peak_extra_bytes, stats.budget_bytes);
    if (max_extra == 0) {
      EXPECT_EQ(stats.units_copied, 0);
    } else {
      EXPECT_GT(stats.units_copied, 0);
      EXPECT_LT(stats.units_copied, stats.units) << "some units are waited for";
    }
  }
}

// The temporary directory of the save at step 4 is removed under the
// writers (slowed, so they are still writing): every rank's Fit stops at a
// later step with the writer's error; step=2.ckpt is intact, step=4 absent.
class RemoveTempDirAtStep4 : public Callback {
 public:
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t) override {
    if (t.global_step() != 4 || t.rank() != 0 || done_) return;
    done_ = true;
    fs::remove_all(ShardedTempDir((fs::path(t.checkpoint_dir()) / "step=4.ckpt").string()));
  }

 private:
  bool done_ = false;
};

TEST(AsyncCheckpoint, AWriterFailureStopsEveryRankAndKeepsTheCheckpointsBefore) {
  WriterDelay slow(40);
  TrainerOptions o = Options(TmpDir("async_fail"), true);
  auto data = MakeData(64, 1);
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<int64_t> steps;
  std::string ckpt_dir;
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    Classifier module;
    TrainerOptions mine = o;
    mine.callbacks = {std::make_shared<RemoveTempDirAtStep4>()};
    Trainer trainer(mine, comm);
    try {
      trainer.Fit(module, *data, nullptr);
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
      steps.push_back(trainer.global_step());
      if (rank == 0) ckpt_dir = trainer.checkpoint_dir();
    }
  });
  ASSERT_EQ(errors.size(), 2u) << "every rank stops";
  for (const auto& e : errors) EXPECT_NE(e.find("step=4.ckpt"), std::string::npos) << e;
  for (int64_t s : steps) EXPECT_LT(s, 12) << "stopped before the end";
  EXPECT_EQ(OpenDcpCheckpoint((fs::path(ckpt_dir) / "step=2.ckpt").string()).meta.global_step, 2);
  EXPECT_FALSE(fs::exists(fs::path(ckpt_dir) / "step=4.ckpt"));
  EXPECT_FALSE(fs::exists(ShardedTempDir((fs::path(ckpt_dir) / "step=4.ckpt").string())));
}

// ModelCheckpoint(save_top_k=1) with a slowed writer: when each new best
// begins, the previous one still exists (deleted only once the new one is
// complete); at the end only the best is left.
class ExpectPreviousBestDuringSave : public Callback {
 public:
  explicit ExpectPreviousBestDuringSave(std::shared_ptr<ModelCheckpoint> mc) : mc_(std::move(mc)) {}
  void on_train_batch_end(Trainer& t, TrainingModule&, const at::Tensor&, int64_t) override {
    if (t.rank() != 0) return;
    const std::string best = mc_->best_model_path();
    if (!previous_.empty() && previous_ != best) {
      EXPECT_TRUE(fs::exists(previous_)) << previous_ << " removed before " << best << " was complete";
      ++checked;
    }
    previous_ = best;
  }
  int checked = 0;

 private:
  std::shared_ptr<ModelCheckpoint> mc_;
  std::string previous_;
};

TEST(AsyncCheckpoint, ModelCheckpointEvictsOnlyOnceTheNewCheckpointIsComplete) {
  WriterDelay slow(40);
  TrainerOptions o = Options(TmpDir("async_topk"), true);
  auto data = MakeData(64, 1);
  int checked = 0;
  std::string dir;
  shardtrain::testing::RunRanks(2, [&](int rank, const auto& comm) {
    ModelCheckpointOptions mo;
    mo.monitor = "train_loss";
    mo.save_top_k = 1;
    mo.every_n_train_steps = 1;
    auto mc = std::make_shared<ModelCheckpoint>(mo);
    auto watch = std::make_shared<ExpectPreviousBestDuringSave>(mc);
    Classifier module;
    TrainerOptions mine = o;
    mine.callbacks = {mc, watch};
    Trainer trainer(mine, comm);
    trainer.Fit(module, *data, nullptr);
    if (rank == 0) {
      checked = watch->checked;
      dir = fs::path(mc->best_model_path()).parent_path().string();
    }
  });
  EXPECT_GT(checked, 0);
  int kept = 0;
  for (const auto& e : fs::directory_iterator(dir)) kept += e.path().filename().string().rfind("epoch=", 0) == 0;
  EXPECT_EQ(kept, 1);
}

}  // namespace
}  // namespace shardtrain::trainer
