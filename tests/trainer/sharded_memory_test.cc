// Memory of sharded checkpoints, threads-as-ranks over Gloo with a counting
// CPU allocator (per rank thread): a W=4 sharded save and loads at W=4, 2
// and 3 must never materialise the full model or optimizer state; the
// training step holds its shards' state and a few units (live and resident;
// see "the training step" below).
//
// The model is kUnits equal units (Linear kDim x kDim each) plus a small
// root unit, trained with Adam so that the optimizer state is twice the
// parameters. Budgets, in bytes allocated by the rank's thread beyond what
// it held before the phase:
//   save: (one unit + the archive writer's buffer) x 1.15 + slack; the
//         shards and the optimizer state are written from the live tensors.
//   load: this rank's new optimizer state (two shard-shaped tensors per
//         unit, at the new world size) + one unit x 1.15 + slack; the
//         parameter shards exist already and are filled in place.
// With use_orig_params the per-parameter state is copied into the shard
// layout one unit at a time (save and load), within the same budgets.
// Measured before the streamed save and the ranged load (W=4): save 6.3 MB
// per rank (budget 2.7 MB; now 5 KB), load 51.5 MB per rank (the full model
// and optimizer state; budget 5.7 MB, now 4.2 MB = the new optimizer state).
//
// The loaded state must equal the saved state exactly: the W=4 checkpoint and
// one saved again right after the load (at the new world size) consolidate
// to bit-identical parameters and optimizer state.
#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <mutex>

#include "sharding/sharded_model.h"
#include "strategies/sharded_strategy_base.h"
#include "tests/testing/counting_allocator.h"
#include "tests/testing/proc_status.h"
#include "tests/trainer/fixtures.h"
#include "tests/trainer/unit_stack.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/checkpoint_io/sharded_checkpoint.h"

namespace shardtrain::trainer {
namespace {
using namespace fixtures;
using shardtrain::testing::LiveCpuBytesOfThisThread;
using shardtrain::testing::PeakCpuBytesOfThisThread;
using shardtrain::testing::ResetPeakCpuBytesOfThisThread;

constexpr int64_t kDim = 512;
constexpr int kUnits = 8;
constexpr int64_t kClasses = 4;
constexpr int64_t kUnitBytes = (kDim * kDim + kDim) * 4;
// What ArchiveWriter may buffer (trainer/checkpoint_io/archive.cc) plus small objects
// (pickle, metadata, Gloo agreement tensors).
constexpr int64_t kWriterBufferBytes = 1 << 20;
constexpr int64_t kSlackBytes = 256 << 10;

// Records the peak bytes of its rank thread from the end of
// configure_optimizers (model sharded, optimizer made) to on_fit_start: what
// Trainer::Fit allocates while it loads `ckpt_path`.
class StackModule : public TrainingModule {
 public:
  std::shared_ptr<torch::nn::Module> configure_model() override {
    auto g = at::detail::createCPUGenerator(11);
    net_ = std::make_shared<UnitStack>(kUnits, kDim, kClasses, &g, 1.0 / std::sqrt(double(kDim)));
    return net_;
  }
  at::Tensor training_step(const Batch& b, int64_t) override {
    return at::cross_entropy_loss(forward([&] { return net_->forward(b.inputs); }), b.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    OptimizerConfig c;
    c.optimizer = std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
    ResetPeakCpuBytesOfThisThread();
    base_ = LiveCpuBytesOfThisThread();
    return c;
  }
  void on_fit_start() override { load_peak = PeakCpuBytesOfThisThread() - base_; }
  int64_t load_peak = -1;

 private:
  std::shared_ptr<UnitStack> net_;
  int64_t base_ = 0;
};

std::shared_ptr<TensorDataset> Data() {
  auto g = at::detail::createCPUGenerator(5);
  at::Tensor x = at::randn({32, kDim}, g);
  return std::make_shared<TensorDataset>(x, x.slice(1, 0, kClasses).argmax(1));
}

TrainerOptions Options(const std::string& root, int world, int64_t max_steps) {
  TrainerOptions o;
  o.default_root_dir = root;
  o.max_steps = max_steps;
  o.max_epochs = -1;
  o.batch_size = 8 / world;
  o.enable_progress_bar = false;
  o.enable_checkpointing = false;
  o.strategy = "fsdp_native";
  o.strategy_options = {{"state_dict_type", "sharded"}};
  return o;
}

// This rank's Adam state (exp_avg, exp_avg_sq) in bytes: two shards per unit.
int64_t OptimizerStateBytes(Trainer& t) {
  int64_t n = 0;
  for (const auto& u : dynamic_cast<strategies::ShardedStrategyBase&>(t.strategy()).sharded_model().units()) n += u.shard_numel;
  return 2 * 4 * n;
}

void ExpectEqualState(const CheckpointData& a, const CheckpointData& b) {
  const auto &pa = a.state_dict, &pb = b.state_dict;
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& [k, v] : pa) EXPECT_TRUE(v.equal(pb.at(k))) << k;
  const auto &oa = a.optimizer_full, &ob = b.optimizer_full;
  EXPECT_EQ(oa.kind, "Adam");
  EXPECT_EQ(oa.kind, ob.kind);
  EXPECT_EQ(oa.step, ob.step);
  ASSERT_EQ(oa.state.size(), pa.size());
  for (const auto& [name, keys] : oa.state) {
    ASSERT_EQ(keys.size(), 2u) << name;
    for (const auto& [k, v] : keys) EXPECT_TRUE(v.equal(ob.state.at(name).at(k))) << name << " " << k;
  }
}

// A W=4 sharded save, then loads at `worlds`, with `extra` strategy options.
void SaveAndLoad(const strategies::StrategyOptions& extra, const std::vector<int>& worlds) {
  shardtrain::testing::InstallCountingCpuAllocator();
  auto data = Data();
  const std::string saved = (fs::path(TmpDir("mem_save")) / "ckpt").string();
  auto options = [&](const std::string& root, int world) {
    TrainerOptions o = Options(root, world, 2);
    for (const auto& [k, v] : extra) o.strategy_options[k] = v;
    return o;
  };
  std::vector<int64_t> save_peak(4, -1);
  shardtrain::testing::RunRanks(4, [&](int rank, const auto& comm) {
    StackModule module;
    Trainer trainer(options(TmpDir("mem_fit" + std::to_string(rank)), 4), comm);
    trainer.Fit(module, *data);
    ResetPeakCpuBytesOfThisThread();
    const int64_t base = LiveCpuBytesOfThisThread();
    trainer.SaveCheckpoint(saved, CheckpointFormat::kSharded);
    save_peak[rank] = PeakCpuBytesOfThisThread() - base;
  });
  const CheckpointData before = ConsolidateDcpCheckpoint(OpenDcpCheckpoint(saved));
  const int64_t full_state = 3 * 4 * (kUnits * (kDim * kDim + kDim) + kDim * kClasses + kClasses);
  const int64_t save_budget = static_cast<int64_t>((kUnitBytes + kWriterBufferBytes) * 1.15) + kSlackBytes;
  for (int r = 0; r < 4; ++r) {
    std::cout << "save W=4 rank " << r << ": peak " << save_peak[r] << " bytes beyond the training state (budget "
              << save_budget << ", full model + Adam " << full_state << ")" << std::endl;
    EXPECT_LE(save_peak[r], save_budget) << "rank " << r;
  }
  for (int world : worlds) {
    SCOPED_TRACE("loaded at W=" + std::to_string(world));
    const std::string again = (fs::path(TmpDir("mem_again" + std::to_string(world))) / "ckpt").string();
    std::vector<int64_t> load_peak(world, -1), budget(world, 0);
    shardtrain::testing::RunRanks(world, [&](int rank, const auto& comm) {
      StackModule module;
      Trainer trainer(options(TmpDir("mem_load" + std::to_string(rank)), world), comm);
      trainer.Fit(module, *data, nullptr, saved);  // loads, then stops at max_steps
      EXPECT_EQ(trainer.global_step(), 2);
      load_peak[rank] = module.load_peak;
      budget[rank] = OptimizerStateBytes(trainer) + static_cast<int64_t>(kUnitBytes * 1.15) + kSlackBytes;
      trainer.SaveCheckpoint(again, CheckpointFormat::kSharded);
    });
    for (int r = 0; r < world; ++r) {
      std::cout << "load W=4 -> W=" << world << " rank " << r << ": peak " << load_peak[r] << " bytes (budget "
                << budget[r] << ")" << std::endl;
      EXPECT_GT(load_peak[r], 0);
      EXPECT_LE(load_peak[r], budget[r]) << "rank " << r;
    }
    ExpectEqualState(before, ConsolidateDcpCheckpoint(OpenDcpCheckpoint(again)));
  }
}

TEST(ShardedCheckpointMemory, SaveAndLoadNeverHoldTheFullModel) { SaveAndLoad({}, {4, 2, 3}); }

// With use_orig_params the optimizer steps each parameter's part of a shard:
// its state is copied into the shard layout one unit at a time.
TEST(ShardedCheckpointMemory, UseOrigParamsCopiesOneUnitAtATime) {
  SaveAndLoad({{"use_orig_params", "true"}}, {2, 4});
}

// ---- the training step -----------------------------------------------------
//
// Steps 2 to 4 of a fit (the AdamW moments exist), threads-as-ranks over
// Gloo at W=2 and W=4, kStepUnits equal units of kStepDim x kStepDim (16 MiB
// each, so a rank's shard of one is >= the 4 MiB mmap threshold of
// sharding/host_memory.h).
//
// Live bytes: what LibTorch's allocator holds for a rank thread at any
// moment of a step stays within the training state of its shards (16 bytes
// per element: parameter, gradient, two AdamW moments) + kStepTransientUnits
// full units + slack. The six units backward may hold at once: the unit
// being differentiated (gathered), the prefetched one, the unit's full
// gradient, two reduce-scatters in flight, and AccumulateGrad's fresh
// gradient of one parameter before it is copied into the flat gradient.
// Measured (units of 16 MiB): W=2 336-353 MB, W=4 210-227 MB of budgets
// 371 and 237 MB. With units of 4 MiB (and a 1 MiB threshold) and every
// unit's full gradient kept after its reduce-scatter: 113.5 and 82.0 MB of
// budgets 94.5 and 60.9 MB.
//
// Resident bytes: freed blocks must not stay resident beyond what is live,
// so the process's resident set (VmHWM) grows by no more than the rank
// threads' peak live bytes together + StepRssSlackBytes(W) = 32 MiB + W x 8
// MiB (code paged in on first use, the shared-memory rings, Gloo's buffers,
// thread stacks). Freed blocks of 1 MiB and more wait in the sharding core's
// host block cache (sharding/host_memory.h, installed under the counting
// allocator), which never holds more than the peak of live bytes. Measured
// growth with glibc and the 4 MiB mmap threshold (SHARDTRAIN_HOST_CACHE=0):
// 679 MB of a 739 MB budget (W=2), 872 of 924 MB (W=4); with the cache (one
// for all rank threads: the peak of their sum): 631 and 541 MB. With units
// of 4 MiB and glibc's default dynamic mmap threshold (both off) the growth
// beyond the live peaks was 204 MB and 395 MB (22 and 26 MB with the
// threshold).
constexpr int64_t kStepDim = 2048;
constexpr int kStepUnits = 8;
constexpr int64_t kStepUnitBytes = (kStepDim * kStepDim + kStepDim) * 4;
constexpr int kStepTransientUnits = 6;
constexpr int64_t kStepSlackBytes = 2 << 20;
int64_t StepRssSlackBytes(int world) { return (int64_t{32} << 20) + world * (int64_t{8} << 20); }
// Under a sanitizer malloc is the sanitizer's (freed blocks wait in its
// quarantine): the resident-set check does not apply.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kGlibcMalloc = false;
#else
constexpr bool kGlibcMalloc = true;
#endif

// The peak live bytes of its rank thread over steps 2.. of a fit.
class StepModule : public TrainingModule {
 public:
  std::shared_ptr<torch::nn::Module> configure_model() override {
    // Threads-as-ranks share the global generator: every rank draws its own alike.
    auto g = at::detail::createCPUGenerator(13);
    net_ = std::make_shared<UnitStack>(kStepUnits, kStepDim, kClasses, &g, 1.0 / std::sqrt(double(kStepDim)));
    return net_;
  }
  at::Tensor training_step(const Batch& b, int64_t) override {
    return at::cross_entropy_loss(forward([&] { return net_->forward(b.inputs); }), b.targets);
  }
  OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    return {std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3))};
  }
  void on_train_batch_start(const Batch&, int64_t i) override {
    if (i >= 2) step_peak = std::max(step_peak, PeakCpuBytesOfThisThread());
    if (i >= 1) ResetPeakCpuBytesOfThisThread();
  }
  void on_fit_end() override { step_peak = std::max(step_peak, PeakCpuBytesOfThisThread()); }
  int64_t step_peak = -1;

 private:
  std::shared_ptr<UnitStack> net_;
};

void StepWithinBudget(int world) {
  shardtrain::testing::InstallCountingCpuAllocator();
  auto g = at::detail::createCPUGenerator(7);
  at::Tensor x = at::randn({32, kStepDim}, g);
  TensorDataset data(x, x.slice(1, 0, kClasses).argmax(1));
  std::vector<int64_t> peak(world, -1), budget(world, 0);
  const int64_t rss_before = shardtrain::testing::ProcStatusKb("VmRSS") * 1024;
  const int64_t heap_free_before = static_cast<int64_t>(mallinfo2().fordblks);
  shardtrain::testing::ResetPeakRss();  // VmHWM := VmRSS
  shardtrain::testing::RunRanks(world, [&](int rank, const auto& comm) {
    StepModule module;
    TrainerOptions o = Options(TmpDir("mem_step" + std::to_string(rank)), world, 4);
    o.batch_size = 8 / world;
    o.strategy_options = {};
    Trainer trainer(o, comm);
    trainer.Fit(module, data);
    peak[rank] = module.step_peak;
    budget[rank] = 2 * OptimizerStateBytes(trainer) + kStepTransientUnits * kStepUnitBytes + kStepSlackBytes;
  });
  const int64_t rss_growth = shardtrain::testing::ProcStatusKb("VmHWM") * 1024 - rss_before;
  const int64_t heap_free_growth = static_cast<int64_t>(mallinfo2().fordblks) - heap_free_before;
  int64_t live_sum = 0;
  for (int r = 0; r < world; ++r) {
    std::cout << "step W=" << world << " rank " << r << ": peak live " << peak[r] << " bytes (budget " << budget[r]
              << " = training state + " << kStepTransientUnits << " units of " << kStepUnitBytes << ")" << std::endl;
    EXPECT_GT(peak[r], 0);
    EXPECT_LE(peak[r], budget[r]) << "rank " << r;
    live_sum += peak[r];
  }
  const int64_t rss_budget = live_sum + StepRssSlackBytes(world);
  std::cout << "W=" << world << ": resident set grew by " << rss_growth << " bytes (budget " << rss_budget
            << " = the ranks' peak live bytes + slack); free bytes in malloc's heap grew by " << heap_free_growth
            << std::endl;
  if (kGlibcMalloc) {
    EXPECT_LE(rss_growth, rss_budget) << "freed host memory stayed resident (sharding/host_memory.h)";
  }
}

TEST(ShardedStepMemory, StepHoldsStateAndAFewUnitsW2) { StepWithinBudget(2); }
TEST(ShardedStepMemory, StepHoldsStateAndAFewUnitsW4) { StepWithinBudget(4); }

}  // namespace
}  // namespace shardtrain::trainer
