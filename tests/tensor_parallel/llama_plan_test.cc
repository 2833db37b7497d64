// The Llama's tensor-parallel plan (examples/llama) under model_parallel at
// W=4 (threads over real Gloo) against single-device training of the same
// model, on configurations a config.json allows: grouped-query heads, a
// head_dim of its own, biases, tied and untied heads, a vocabulary and an MLP
// that do not divide by the group; and Hugging Face directories in and out of
// a tensor-parallel model at their global shapes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <filesystem>
#include <mutex>

#include "base/errors.h"
#include "examples/llama/hf_checkpoint.h"
#include "examples/llama/hf_strategy_io.h"
#include "examples/llama/llama_model.h"
#include "strategies/model_parallel/model_parallel_strategy.h"
#include "tests/testing/multi_rank.h"

namespace shardtrain::strategies {
namespace {

using examples::llama::LlamaConfig;
using examples::llama::LlamaForCausalLMImpl;

constexpr int kLlamaSteps = 3;
constexpr int kRows = 4;
constexpr int64_t kLength = 7;    // not a multiple of the group: sequence parallelism pads
constexpr double kLlamaMaxNorm = 0.5;  // every step clips

std::shared_ptr<LlamaForCausalLMImpl> Build(const LlamaConfig& c) {
  static std::mutex mu;  // one global generator: ranks build one at a time, from the same seed
  std::lock_guard<std::mutex> lock(mu);
  at::manual_seed(5);
  return std::make_shared<LlamaForCausalLMImpl>(c);
}

at::Tensor Rows(const LlamaConfig& c, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
  return at::randint(c.vocab_size, {kRows, kLength + 1}, gen);
}

// eps 1e-3: Adam moves an element whose gradient is near eps by up to
// lr / (4 eps) times its rounding error (a key bias's gradient is rounding
// noise: softmax ignores a shift of every key). Sequence parallelism pads the
// sequence, so its products have other shapes and round otherwise; with eps
// 1e-5 an embedding element then ended 1.9e-5 away (1.2e-6 unpadded).
torch::optim::AdamWOptions LlamaAdam() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-3); }

struct LlamaRun {
  std::vector<double> losses, norms;
  std::map<std::string, at::Tensor> weights;
};

LlamaRun SingleDevice(const LlamaConfig& c) {
  auto model = Build(c);
  torch::optim::AdamW opt(model->parameters(), LlamaAdam());
  LlamaRun run;
  for (int step = 0; step < kLlamaSteps; ++step) {
    const at::Tensor rows = Rows(c, step);
    opt.zero_grad();
    at::Tensor loss = LlamaForCausalLMImpl::Loss(model->forward(rows.slice(1, 0, -1)), rows.slice(1, 1));
    loss.backward();
    run.losses.push_back(loss.item<double>());
    run.norms.push_back(ClipLocalGradNorm(model->parameters(), kLlamaMaxNorm, 2.0).item<double>());
    opt.step();
  }
  for (const auto& p : model->named_parameters()) run.weights[p.key()] = p.value().detach().clone();
  return run;
}

std::shared_ptr<LlamaForCausalLMImpl> SetUpAndWrap(ModelParallelStrategy& s,
                                                   const std::shared_ptr<comm::GlooCommunicator>& world,
                                                   const LlamaConfig& c) {
  s.Setup(world, ClusterInfo{});
  std::shared_ptr<LlamaForCausalLMImpl> model;
  {
    auto scope = s.MakeConstructionScope();
    model = Build(c);
  }
  s.WrapModel(model);
  return model;
}

void ExpectNear(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    ASSERT_EQ(got.at(name).sizes(), w.sizes()) << name;
    EXPECT_LE((got.at(name) - w).abs().max().item<double>(), 1e-5 * std::max(1.0, w.abs().max().item<double>()))
        << name;
  }
}

struct PlanCase {
  const char* name;
  int dp;
  bool sequence_parallel;
  LlamaConfig config;
};

LlamaConfig GqaBiasesUntied() {  // heads 4 / kv 2, head_dim 8 (not 24 / 4), biases, untied head
  LlamaConfig c;
  c.vocab_size = 40;
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.attention_bias = c.mlp_bias = true;
  c.tie_word_embeddings = false;
  c.initializer_range = 0.2;
  return c;
}

LlamaConfig MhaTiedUneven() {  // vocab 37 and intermediate 30: torch.chunk's uneven split over 4
  LlamaConfig c = GqaBiasesUntied();
  c.vocab_size = 37;
  c.intermediate_size = 30;
  c.num_key_value_heads = 4;
  c.head_dim = 6;
  c.attention_bias = c.mlp_bias = false;
  c.tie_word_embeddings = true;
  return c;
}

class LlamaPlan : public ::testing::TestWithParam<PlanCase> {};

TEST_P(LlamaPlan, TrainingEqualsSingleDevice) {
  const PlanCase& pc = GetParam();
  const LlamaRun want = SingleDevice(pc.config);
  shardtrain::testing::RunRanks(4, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
    ModelParallelOptions o;
    o.data_parallel_size = pc.dp;
    o.tensor_parallel_size = 4 / pc.dp;
    o.sequence_parallel = pc.sequence_parallel;
    ModelParallelStrategy s(o);
    const auto model = SetUpAndWrap(s, world, pc.config);
    torch::optim::AdamW opt(s.parameters(), LlamaAdam());
    const int per = kRows / pc.dp, first = s.mesh().dp_rank * per;
    for (int step = 0; step < kLlamaSteps; ++step) {
      const at::Tensor rows = Rows(pc.config, step).slice(0, first, first + per);
      opt.zero_grad();
      at::Tensor logits = s.Forward([&] { return model->forward(rows.slice(1, 0, -1)); });
      ASSERT_EQ(logits.size(1), kLength);
      at::Tensor loss = model->LossOf(logits, rows.slice(1, 1));
      s.Backward(loss);
      const double norm = s.ClipGradients(kLlamaMaxNorm, GradClipAlgorithm::kNorm);
      opt.step();
      EXPECT_NEAR(s.ReduceMean(loss.item<double>()), want.losses[step], 1e-5 * want.losses[step]) << "step " << step;
      EXPECT_NEAR(norm, want.norms[step], 1e-5 * want.norms[step]) << "step " << step;
    }
    const auto state = s.FullStateDict();
    if (rank == 0) ExpectNear(state, want.weights);
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, LlamaPlan,
                         ::testing::Values(PlanCase{"gqa_biases_untied_2x2_sp", 2, true, GqaBiasesUntied()},
                                           PlanCase{"gqa_biases_untied_2x2", 2, false, GqaBiasesUntied()},
                                           PlanCase{"mha_tied_uneven_1x4", 1, false, MhaTiedUneven()}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(LlamaPlanErrors, HeadsThatDoNotDivideNameTheFix) {
  LlamaConfig c = GqaBiasesUntied();
  c.num_key_value_heads = 1;  // MQA over 2 ranks
  std::vector<std::string> errors(4);
  shardtrain::testing::RunRanks(4, [&](int rank, const std::shared_ptr<comm::GlooCommunicator>& world) {
    ModelParallelOptions o;
    o.tensor_parallel_size = 2;
    ModelParallelStrategy s(o);
    s.Setup(world, ClusterInfo{});
    auto scope = s.MakeConstructionScope();
    try {
      Build(c);
    } catch (const InvalidArgumentError& e) {
      errors[rank] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("num_attention_heads (4) and num_key_value_heads (1) must divide by tensor_parallel_size (2)"),
              std::string::npos)
        << e;
  }
}

// A Hugging Face directory loads into a 2x2 model (each rank cuts its
// pieces), which gives the single-device model's logits and saves the same
// tensors back at their global shapes; decoding with a cache is refused.
TEST(LlamaPlanHf, LoadsAndSavesAtGlobalShapes) {
  namespace fs = std::filesystem;
  const LlamaConfig c = GqaBiasesUntied();
  const fs::path dir = fs::path(::testing::TempDir()) / "llama_plan_hf", out = dir.string() + "_saved";
  fs::remove_all(dir);
  fs::remove_all(out);
  auto reference = Build(c);
  {
    at::NoGradGuard no_grad;
    for (auto& p : reference->parameters()) p.add_(at::randn_like(p) * 0.1);  // not the seed's weights
  }
  examples::llama::SaveHfModel(dir.string(), c, *reference, examples::llama::HfSaveOptions());
  const at::Tensor ids = Rows(c, 0).slice(1, 0, -1);
  at::Tensor want;
  {
    at::NoGradGuard no_grad;
    want = reference->forward(ids);
  }
  const examples::llama::HfWeights weights(dir.string());
  std::vector<std::string> generate_errors(4);
  shardtrain::testing::RunRanks(4, [&](int, const std::shared_ptr<comm::GlooCommunicator>& world) {
    ModelParallelOptions o;
    o.tensor_parallel_size = 2;
    o.sequence_parallel = true;
    ModelParallelStrategy s(o);
    const auto model = SetUpAndWrap(s, world, c);
    examples::llama::LoadHfWeightsInto(s, c, weights);
    at::NoGradGuard no_grad;
    const at::Tensor logits = model->GatherLogits(s.Forward([&] { return model->forward(ids); }));
    EXPECT_LE((logits - want).abs().max().item<double>(), 1e-5);
    examples::llama::SaveHfModel(s, out.string(), c, examples::llama::HfSaveOptions());
    try {
      model->Generate(ids.slice(0, 0, 1), examples::llama::GenerateOptions());
    } catch (const InvalidArgumentError& e) {
      generate_errors[world->rank()] = e.what();
    }
  });
  const examples::llama::HfWeights saved(out.string());
  for (const auto& p : reference->named_parameters()) EXPECT_TRUE(saved.Tensor(p.key()).equal(p.value())) << p.key();
  for (const std::string& e : generate_errors) EXPECT_NE(e.find("needs the whole model"), std::string::npos) << e;
}

}  // namespace
}  // namespace shardtrain::strategies
