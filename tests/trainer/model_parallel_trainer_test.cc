// The model_parallel strategy through the Trainer on the example GPT (its
// tensor-parallel plan): W=4 at 2x2 with sequence parallelism and at 1x4 train
// as single_device does on the same global batches (losses and weights 1e-5),
// the tensor-parallel ranks reading the same batches.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <barrier>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/testing/multi_rank.h"
#include "tests/trainer/gpt_module.h"
#include "trainer/checkpoint_io/dcp_checkpoint.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace {

using testing::GptModule;

struct Result {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> weights;
  std::string last_ckpt;
};

// What Fit changes beyond the defaults: micro-batches per step, GptModule's frozen parameters.
struct Extra {
  int64_t accumulate = 1;
  bool freeze = false;
};

// max_steps 3 (or `steps`), with a full checkpoint at the end, from `ckpt_path` if given; and a sharded
// checkpoint at `sharded_out` if given.
Result FitGpt(int world, const std::string& strategy, const strategies::StrategyOptions& options, int batch_size,
              int steps = 3, const std::string& ckpt_path = "", const std::string& sharded_out = "", Extra extra = {}) {
  TensorDataset data = testing::SmallGptData();
  Result result;
  std::barrier<> seeded(world);
  shardtrain::testing::RunRanks(world, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& comm) {
    TrainerOptions o;
    o.default_root_dir = ::testing::TempDir() + "/model_parallel_trainer_" + std::to_string(world) + "_" +
                         std::to_string(batch_size) + "_" + std::to_string(steps) + "_" +
                         std::to_string(extra.accumulate) + (extra.freeze ? "_frozen" : "");
    o.max_steps = steps;
    o.batch_size = batch_size;
    o.shuffle = false;
    o.gradient_clip_val = 0.5;
    o.enable_logger = false;
    o.enable_progress_bar = false;
    o.enable_model_summary = false;
    o.strategy = strategy;
    o.strategy_options = options;
    o.accumulate_grad_batches = extra.accumulate;
    GptModule module(extra.freeze, &seeded);
    Trainer t(o, comm);
    t.Fit(module, data, nullptr, ckpt_path);
    if (!sharded_out.empty()) t.SaveCheckpoint(sharded_out, CheckpointFormat::kSharded);
    auto sd = t.strategy().FullStateDict();
    if (rank == 0) result = {t.step_losses(), sd, t.last_checkpoint_path()};
  });
  return result;
}

void ExpectSameWeights(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, w] : want) {
    ASSERT_EQ(got.at(name).sizes(), w.sizes()) << what << " " << name;
    EXPECT_LE((got.at(name) - w).abs().max().item<double>(), 1e-5 * std::max(1.0, w.abs().max().item<double>()))
        << what << " " << name;
  }
}

TEST(ModelParallelTrainer, GptTrainsAsSingleDeviceDoes) {
  const Result want = FitGpt(1, "single_device", {}, 4);
  ASSERT_EQ(want.losses.size(), 3u);
  const std::vector<std::pair<std::string, strategies::StrategyOptions>> meshes = {
      {"2x2 sequence parallel", {{"tensor_parallel_size", "2"}, {"sequence_parallel", "true"}}},
      {"1x4", {{"tensor_parallel_size", "4"}}},
  };
  for (const auto& [what, options] : meshes) {
    const int dp = what[0] - '0';
    const Result got = FitGpt(4, "model_parallel", options, 4 / dp);
    ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
    for (size_t i = 0; i < want.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * want.losses[i]) << what << " step " << i;
    }
    ExpectSameWeights(got.weights, want.weights, what);
  }
}

// Gradient accumulation (2 micro-batches per step) and frozen parameters (a
// column-wise weight, the final norm) at 2x2 with sequence parallelism, and
// with fsdp_native at W=2, train as single_device does; the frozen ones do not
// move (and the full checkpoint at the end holds no optimizer state for them:
// both failed to save before).
TEST(ModelParallelTrainer, AccumulationAndFrozenParametersAsSingleDevice) {
  const Extra extra{2, true};
  const Result want = FitGpt(1, "single_device", {}, 2, 3, "", "", extra);
  // The same under fsdp_native (flat parameters): its full checkpoint holds no state for frozen ones either.
  const Result fsdp = FitGpt(2, "fsdp_native", {{"sharded_construction", "false"}}, 1, 3, "", "", extra);
  ExpectSameWeights(fsdp.weights, want.weights, "fsdp_native accumulation + frozen");
  const Result got =
      FitGpt(4, "model_parallel", {{"tensor_parallel_size", "2"}, {"sequence_parallel", "true"}}, 1, 3, "", "", extra);
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * want.losses[i]);
  ExpectSameWeights(got.weights, want.weights, "accumulation + frozen");
  at::manual_seed(5);
  const examples::GptImpl initial(testing::SmallGptConfig());
  for (const auto& p : initial.named_parameters()) {
    if (GptModule::Frozen(p.key())) {
      EXPECT_TRUE(got.weights.at(p.key()).equal(p.value())) << p.key() << " moved while frozen";
    }
  }
}

// A full checkpoint saved at 2x2 (weights and AdamW moments at global shapes)
// resumes at 1x4, 4x1 and with single_device, continuing as the uninterrupted run.
TEST(ModelParallelTrainer, FullCheckpointAt2x2ResumesAtOtherMeshesAndSingleDevice) {
  const Result want = FitGpt(1, "single_device", {}, 4);
  const Result first =
      FitGpt(4, "model_parallel", {{"tensor_parallel_size", "2"}, {"sequence_parallel", "true"}}, 2, 2);
  ASSERT_EQ(first.losses.size(), 2u);
  ASSERT_FALSE(first.last_ckpt.empty());
  const std::vector<std::pair<std::string, Result>> resumed = {
      {"1x4", FitGpt(4, "model_parallel", {{"tensor_parallel_size", "4"}}, 4, 3, first.last_ckpt)},
      {"4x1", FitGpt(4, "model_parallel", {{"tensor_parallel_size", "1"}}, 1, 3, first.last_ckpt)},
      {"single_device", FitGpt(1, "single_device", {}, 4, 3, first.last_ckpt)},
  };
  for (const auto& [what, r] : resumed) {
    ASSERT_EQ(r.losses.size(), 1u) << what;
    EXPECT_NEAR(r.losses[0], want.losses[2], 1e-5 * want.losses[2]) << what;
    ExpectSameWeights(r.weights, want.weights, what);
  }
}

// A sharded (DCP) checkpoint saved at 2x2 with sequence parallelism holds
// every parameter at its global shape, assembled from the ranks' chunks
// (c_attn's three blocks per rank, row-wise columns, vocabulary rows) equal to
// the full state bit for bit, and resumes at 1x4, 4x1, 1x1 and with
// single_device, continuing as the uninterrupted run.
TEST(ModelParallelTrainer, ShardedCheckpointAt2x2ResumesAtOtherMeshes) {
  const Result want = FitGpt(1, "single_device", {}, 4);
  const std::string dir = ::testing::TempDir() + "/model_parallel_sharded_2x2";
  const Result first =
      FitGpt(4, "model_parallel", {{"tensor_parallel_size", "2"}, {"sequence_parallel", "true"}}, 2, 2, "", dir);
  ASSERT_TRUE(IsDcpCheckpoint(dir));
  // save_distributed_checkpoint: the Trainer's own checkpoints are sharded too.
  const Result dist =
      FitGpt(4, "model_parallel", {{"tensor_parallel_size", "2"}, {"save_distributed_checkpoint", "true"}}, 2, 1);
  EXPECT_TRUE(IsDcpCheckpoint(dist.last_ckpt)) << dist.last_ckpt;
  const DcpCheckpoint ck = OpenDcpCheckpoint(dir);
  for (const auto& [name, w] : first.weights) {
    EXPECT_TRUE(AssembleDcpTensor(*ck.reader, ck.model_prefix + name).equal(w)) << name;
  }
  const std::vector<std::pair<std::string, Result>> resumed = {
      {"1x4", FitGpt(4, "model_parallel", {{"tensor_parallel_size", "4"}}, 4, 3, dir)},
      {"4x1", FitGpt(4, "model_parallel", {{"tensor_parallel_size", "1"}}, 1, 3, dir)},
      {"1x1", FitGpt(1, "model_parallel", {}, 4, 3, dir)},
      {"single_device", FitGpt(1, "single_device", {}, 4, 3, dir)},
  };
  for (const auto& [what, r] : resumed) {
    ASSERT_EQ(r.losses.size(), 1u) << what;
    EXPECT_NEAR(r.losses[0], want.losses[2], 1e-5 * want.losses[2]) << what;
    ExpectSameWeights(r.weights, want.weights, what);
  }
}

}  // namespace
}  // namespace shardtrain::trainer
