// Checkpoints do not materialise the full model: threads-as-ranks
// (fsdp_native FULL_SHARD, Adam) through the Trainer, a model of 8 equal
// units, with LibTorch's CPU allocator counted per rank thread
// (tests/testing/counting_allocator.h) and the process's resident pages of
// mapped checkpoint files (RssFile) read while every rank is inside its load.
// During the full save and during the full load, each rank's peak live bytes
// beyond its training state stay within one unit's parameters and Adam state
// (x 1.15) plus slack; holding the whole model (8 units) anywhere breaks that
// many times over. Loads at another world size than the save's (sharded:
// saved at W=2, loaded at W=3 and W=4; full: saved at W=2, loaded at W=3)
// hold at most one unit's parameters beyond the loaded state on the heap, and
// keep no source record resident once its slice is copied.
#include <gtest/gtest.h>

#include <array>
#include <barrier>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "sharding/sharded_model.h"
#include "strategies/sharded_strategy_base.h"
#include "tests/testing/counting_allocator.h"
#include "tests/trainer/fixtures.h"
#include "tests/trainer/unit_stack.h"
#include "trainer/checkpoint_io/checkpoint.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;
namespace st = shardtrain::testing;

constexpr int kWorld = 4;
constexpr int kUnits = 8;
constexpr int64_t kDim = 384;
// One unit: Linear(dim, dim) as float32.
constexpr int64_t UnitBytes(int64_t dim) { return (dim * dim + dim) * 4; }
constexpr int64_t kUnitBytes = UnitBytes(kDim);
// One unit's parameters and its Adam state (exp_avg, exp_avg_sq).
constexpr int64_t kUnitStateBytes = 3 * kUnitBytes;
constexpr int64_t kSlack = 256 << 10;
const int64_t kBound = static_cast<int64_t>(1.15 * kUnitStateBytes) + kSlack;

// The loads at another world size use larger units, so that one record (a
// source shard of one unit) is far above the page-granular residue a copy
// leaves (partial pages at record ends, the kernel's fault-around).
constexpr int64_t kBigDim = 1024;
constexpr int64_t kBigUnitBytes = UnitBytes(kBigDim);

// This process's resident pages of mapped files (RssFile), in bytes.
int64_t RssFileBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("RssFile:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  }
  return -1;
}

// Every rank meets here twice: once its optimizer is made (before the load),
// and inside its load once everything is copied (on_load_checkpoint: the
// checkpoint's mapped files are still open). The second meeting records how
// many more pages of mapped files the process holds than at the first: the
// source records the ranks read and did not let go of.
class MappedResidue {
 public:
  explicit MappedResidue(int world) : sync_(world, Completion{this}) {}
  void Meet() { sync_.arrive_and_wait(); }
  int64_t residue() const { return after_ - before_; }

 private:
  struct Completion {
    MappedResidue* self;
    void operator()() noexcept {
      if (self->meetings_++ == 0) {
        self->before_ = RssFileBytes();
      } else {
        self->after_ = RssFileBytes();
      }
    }
  };
  int meetings_ = 0;
  int64_t before_ = 0, after_ = 0;
  std::barrier<Completion> sync_;
};

// Records the live bytes when the optimizer is made (the last user code
// before a checkpoint is loaded) and the peak and live bytes at on_fit_start
// (right after it is loaded).
class StackModule : public TrainingModule {
 public:
  explicit StackModule(int64_t dim = kDim, MappedResidue* residue = nullptr) : dim_(dim), residue_(residue) {}
  std::shared_ptr<torch::nn::Module> configure_model() override {
    auto g = at::detail::createCPUGenerator(7);
    net_ = std::make_shared<UnitStack>(kUnits, dim_, 3, &g, 0.05);
    return net_;
  }
  at::Tensor training_step(const Batch& b, int64_t) override {
    at::Tensor x = at::cat({b.inputs, at::zeros({b.inputs.size(0), dim_ - b.inputs.size(1)})}, 1);
    at::Tensor out = forward([&] { return net_->forward(x); });
    return at::cross_entropy_loss(out, b.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    OptimizerConfig c;
    c.optimizer = std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
    if (residue_) residue_->Meet();
    st::ResetPeakCpuBytesOfThisThread();
    return c;
  }
  void on_load_checkpoint(const std::map<std::string, std::string>&) override {
    if (residue_) residue_->Meet();
  }
  void on_fit_start() override {
    peak_before_start = st::PeakCpuBytesOfThisThread();
    live_at_start = st::LiveCpuBytesOfThisThread();
  }
  int64_t peak_before_start = 0, live_at_start = 0;
  std::shared_ptr<UnitStack> net_;

 private:
  int64_t dim_;
  MappedResidue* residue_;
};

TrainerOptions Options(const std::string& root, int world = kWorld) {
  TrainerOptions o = BaseOptions(root, world);
  o.strategy = "fsdp_native";
  o.strategy_options = {{"sharding_strategy", "FULL_SHARD"}};
  o.enable_checkpointing = false;
  o.max_epochs = -1;
  o.max_steps = 2;
  return o;
}

TEST(FullCheckpointMemory, SaveAndLoadHoldAboutOneUnitPerRank) {
  st::InstallCountingCpuAllocator();
  const std::string dir = TmpDir("full_memory");
  const std::string path = dir + "/full.ckpt";
  auto train = MakeData(64, 1);
  std::array<int64_t, kWorld> save_extra{}, load_extra{};
  std::array<int, kWorld> units{};
  shardtrain::testing::RunRanks(kWorld, [&](int rank, const auto& comm) {
    StackModule module;
    Trainer trainer(Options(dir + "/fit"), comm);
    trainer.Fit(module, *train, nullptr);
    units[rank] = dynamic_cast<strategies::ShardedStrategyBase&>(trainer.strategy()).sharded_model().num_units();
    const int64_t base = st::LiveCpuBytesOfThisThread();  // shards, gradients, Adam state
    st::ResetPeakCpuBytesOfThisThread();
    trainer.SaveCheckpoint(path, CheckpointFormat::kFull);
    save_extra[rank] = st::PeakCpuBytesOfThisThread() - base;
  });
  shardtrain::testing::RunRanks(kWorld, [&](int rank, const auto& comm) {
    StackModule module;
    Trainer trainer(Options(dir + "/resume"), comm);
    trainer.Fit(module, *train, nullptr, path);  // loads, then stops: max_steps is reached
    load_extra[rank] = module.peak_before_start - module.live_at_start;
    EXPECT_EQ(trainer.global_step(), 2);
  });
  std::printf("unit: %lld bytes of parameters, %lld with Adam state; bound %lld bytes\n",
              static_cast<long long>(kUnitBytes), static_cast<long long>(kUnitStateBytes),
              static_cast<long long>(kBound));
  for (int r = 0; r < kWorld; ++r) {
    std::printf("rank %d: full save peak %lld bytes beyond training state (%.2f units), full load %lld (%.2f)\n", r,
                static_cast<long long>(save_extra[r]), double(save_extra[r]) / kUnitBytes,
                static_cast<long long>(load_extra[r]), double(load_extra[r]) / kUnitBytes);
  }
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(units[r], kUnits + 1) << "8 blocks and the root";
    EXPECT_LE(save_extra[r], kBound) << "rank " << r << " held more than one unit during the full save";
    EXPECT_LE(load_extra[r], kBound) << "rank " << r << " held more than one unit during the full load";
  }
  // The file is complete: every parameter and its Adam state, at full size.
  CheckpointData ck = LoadCheckpoint(path);
  EXPECT_EQ(ck.state_dict.at("b3.fc.weight").sizes(), (std::vector<int64_t>{kDim, kDim}));
  EXPECT_EQ(ck.optimizer_full.kind, "Adam");
  EXPECT_EQ(ck.optimizer_full.state.at("b7.fc.bias").at("exp_avg_sq").numel(), kDim);
  EXPECT_TRUE(ck.optimizer_states.empty()) << "Adam state is stored once, by name";
}

// Trains kBigDim units for 2 steps at W=2 and writes both checkpoint kinds
// into `dir` (full.ckpt, sharded/).
void SaveBigAtTwoRanks(const std::string& dir) {
  auto train = MakeData(64, 1);
  shardtrain::testing::RunRanks(2, [&](int, const auto& comm) {
    StackModule module(kBigDim);
    Trainer trainer(Options(dir + "/fit", 2), comm);
    trainer.Fit(module, *train, nullptr);
    trainer.SaveCheckpoint(dir + "/full.ckpt", CheckpointFormat::kFull);
    trainer.SaveCheckpoint(dir + "/sharded", CheckpointFormat::kSharded);
  });
}

struct LoadMemory {
  std::vector<int64_t> heap_extra;  // per rank: peak live bytes during the load beyond the loaded state
  int64_t mapped_residue = 0;       // the process's resident mapped-file bytes left by the load
};

LoadMemory LoadBig(const std::string& path, int world, const std::string& root) {
  auto train = MakeData(64, 1);
  LoadMemory out;
  out.heap_extra.assign(world, 0);
  MappedResidue residue(world);
  std::mutex mu;
  shardtrain::testing::RunRanks(world, [&](int rank, const auto& comm) {
    StackModule module(kBigDim, &residue);
    Trainer trainer(Options(root, world), comm);
    trainer.Fit(module, *train, nullptr, path);  // loads, then stops: max_steps is reached
    std::lock_guard<std::mutex> lock(mu);
    out.heap_extra[rank] = module.peak_before_start - module.live_at_start;
    EXPECT_EQ(trainer.global_step(), 2);
  });
  out.mapped_residue = residue.residue();
  return out;
}

// One record of the W=2 saves: one unit's source shard of one tensor.
constexpr int64_t kBigRecordBytes = kBigUnitBytes / 2;
// Heap: beyond its loaded shards and Adam state, a rank holds at most one
// unit's parameters (the slice being copied) plus slack.
constexpr int64_t kBigHeapBound = kBigUnitBytes + kSlack;
// Mapped files: per rank one record, plus a page-granular residue (record
// ends, the kernel's fault-around: up to 64 KiB around each touched page).
int64_t MappedBound(int world) { return world * (kBigRecordBytes + (2 << 20)); }

void ExpectLoadWithinBounds(const LoadMemory& m, int world, const char* what) {
  std::printf("%s at W=%d: mapped residue %lld bytes (bound %lld; %.2f unit states)\n", what, world,
              static_cast<long long>(m.mapped_residue), static_cast<long long>(MappedBound(world)),
              double(m.mapped_residue) / (3 * kBigUnitBytes));
  EXPECT_LE(m.mapped_residue, MappedBound(world))
      << what << " at W=" << world << ": the ranks kept pages of the source records they had copied";
  for (int r = 0; r < world; ++r) {
    std::printf("  rank %d: heap extra %lld bytes (%.2f units of parameters; bound %lld)\n", r,
                static_cast<long long>(m.heap_extra[r]), double(m.heap_extra[r]) / kBigUnitBytes,
                static_cast<long long>(kBigHeapBound));
    EXPECT_LE(m.heap_extra[r], kBigHeapBound)
        << what << " at W=" << world << ": rank " << r << " held more than its slice plus one unit";
  }
}

TEST(ShardedCheckpointMemory, LoadAtAnotherWorldSizeReadsOnlyItsSlices) {
  st::InstallCountingCpuAllocator();
  const std::string dir = TmpDir("sharded_load_memory");
  SaveBigAtTwoRanks(dir);
  for (int world : {3, 4}) {
    ExpectLoadWithinBounds(LoadBig(dir + "/sharded", world, dir + "/w" + std::to_string(world)), world,
                           "sharded load");
  }
}

TEST(FullCheckpointMemory, OptimizerStateLoadsRecordByRecordAtAnotherWorldSize) {
  st::InstallCountingCpuAllocator();
  const std::string dir = TmpDir("full_load_memory");
  SaveBigAtTwoRanks(dir);
  ExpectLoadWithinBounds(LoadBig(dir + "/full.ckpt", 3, dir + "/w3"), 3, "full load");
}

}  // namespace
}  // namespace shardtrain::trainer
