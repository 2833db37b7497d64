// examples/llama: the config reader (both transformers schemas), Hugging Face
// directories (index, errors, sizes), and, as modes the Python oracle test
// drives (llama_hf_python_test.sh):
//   llama_test check DIR EXPECTED   logits and greedy generation against
//                                   transformers' (EXPECTED: a safetensors file
//                                   llama_hf_check.py wrote)
//   llama_test export SRC DST SIZE DTYPE   import SRC, export to DST unchanged
//   llama_test tokenize MODEL OUT TEXT...  ids of each TEXT ("0", "1", ...) and
//                                          their decoding ("decoded0", ...)
//                                          into OUT (MODEL: tokenizer.model or
//                                          tokenizer.json)
//   llama_test fit DIR REFERENCE   10 AdamW steps of fsdp_native FULL_SHARD at
//                                  W=2 from DIR on REFERENCE's batches: losses
//                                  and weights against PyTorch FSDP2's
//                                  (llama_hf_check.py fsdp2)
//   llama_test fit-tp DIR REFERENCE  the same with model_parallel at 2x2
//                                    (W=4) against PyTorch's DTensor tensor
//                                    parallel + FSDP2 (llama_hf_check.py tp)
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "base/errors.h"
#include "examples/llama/chat_template.h"
#include "examples/llama/hf_checkpoint.h"
#include "examples/llama/hf_strategy_io.h"
#include "examples/llama/llama_model.h"
#include "examples/llama/sft_data.h"
#include "examples/llama/tokenizer.h"
#include "strategies/registry.h"
#include "strategies/strategy.h"
#include "tests/testing/multi_rank.h"
#include "trainer/checkpoint_io/safetensors.h"

namespace shardtrain::examples::llama {
namespace {

namespace fs = std::filesystem;

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

LlamaForCausalLM LoadModel(const std::string& dir) {
  HfModelDir hf(dir);
  LlamaForCausalLM model(hf.config);
  LoadHfWeights(*model, hf.config, hf.weights);
  model->eval();
  return model;
}

// Logits, greedy ids and teacher-forced logits over them equal transformers'.
int Check(const std::string& dir, const std::string& expected_path) {
  constexpr double kTol = 1e-5;
  LlamaForCausalLM model = LoadModel(dir);
  trainer::SafetensorsFile expected(expected_path);
  at::NoGradGuard no_grad;
  const double logits_diff = MaxAbsDiff(model->forward(expected.Tensor("input_ids")), expected.Tensor("logits"));
  std::cout << dir << ": " << model->config().ToString() << "\n  logits max |diff| " << logits_diff << "\n";
  bool ok = logits_diff <= kTol;
  const at::Tensor prompt = expected.Tensor("prompt_ids").clone(), want = expected.Tensor("generated_ids");
  GenerateOptions options;
  options.greedy = true;
  options.max_new_tokens = want.size(1) - prompt.size(1);
  const at::Tensor got = model->Generate(prompt, options);
  const bool same_ids = got.sizes() == want.sizes() && got.equal(want);
  std::cout << "  greedy generate: " << (same_ids ? "same ids" : "DIFFERENT ids") << " ("
            << got.size(1) - prompt.size(1) << " new tokens)\n";
  if (!same_ids) std::cout << "  got  " << got << "\n  want " << want << "\n";
  ok = ok && same_ids;
  const double forced_diff = MaxAbsDiff(model->forward(want), expected.Tensor("generated_logits"));
  std::cout << "  teacher-forced logits max |diff| " << forced_diff << "\n";
  ok = ok && forced_diff <= kTol;
  std::cout << (ok ? "  OK\n" : "  FAIL (tolerance 1e-5)\n");
  return ok ? 0 : 1;
}

// Token ids of each text file under "0", "1", ... and the text decoded from
// them as bytes under "decoded0", ... (llama_train_check.py tokens).
int Tokenize(const std::string& model, const std::string& out, const std::vector<std::string>& texts) {
  const auto tok = LoadTokenizer(model);
  std::vector<trainer::SafetensorsEntry> layout;
  std::vector<at::Tensor> tensors;
  auto add = [&](const std::string& name, at::Tensor t) {
    trainer::SafetensorsEntry e;
    e.name = name;
    e.dtype = t.scalar_type();
    e.shape = {t.numel()};
    layout.push_back(e);
    tensors.push_back(std::move(t));
  };
  for (size_t i = 0; i < texts.size(); ++i) {
    std::ifstream in(texts[i], std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    const std::vector<int64_t> ids = tok->Encode(text.str());
    const std::string decoded = tok->Decode(ids);
    add(std::to_string(i), at::tensor(ids, at::kLong));
    add("decoded" + std::to_string(i),
        at::tensor(std::vector<uint8_t>(decoded.begin(), decoded.end()), at::TensorOptions(at::kByte)));
  }
  trainer::WriteSafetensors(out, layout, [&](size_t i) { return tensors[i]; });
  return 0;
}

int Export(const std::string& src, const std::string& dst, const std::string& size, const std::string& dtype) {
  HfModelDir hf(src);
  LlamaForCausalLM model(hf.config);
  LoadHfWeights(*model, hf.config, hf.weights);
  HfSaveOptions options;
  options.max_shard_bytes = ParseHfSize(size);
  options.dtype = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  for (const std::string& f : SaveHfModel(dst, hf.config, *model, options)) std::cout << dst << "/" << f << "\n";
  return 0;
}

// What one rank of Fit() ends with.
struct FitResult {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> state;
};

// How Fit() trains: a strategy at a world size.
struct FitSetup {
  std::string label;  // what the reference is, for the report
  std::string strategy;
  strategies::StrategyOptions options;
  int world;
};

FitResult FitWith(const HfModelDir& hf, const at::Tensor& batches, const FitSetup& setup) {
  constexpr double kLr = 1e-3, kWeightDecay = 0.01;  // llama_hf_check.py's FIT_LR, FIT_WD
  FitResult result;
  testing::RunRanks(setup.world, [&](int rank, const auto& comm) {
    auto s = strategies::StrategyRegistry::Create(setup.strategy, setup.options);
    s->Setup(comm, ClusterInfo());
    LlamaForCausalLM model(nullptr);
    {
      auto scope = s->MakeConstructionScope();  // model_parallel: each rank builds its tensor-parallel pieces
      ZeroInitScope zero;
      model = LlamaForCausalLM(hf.config);
    }
    s->WrapModel(model.ptr());
    LoadHfWeightsInto(*s, hf.config, hf.weights);
    torch::optim::AdamW opt(s->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));
    const int64_t per = batches.size(1) / s->data_parallel_size(), first = s->data_parallel_rank() * per;
    std::vector<double> losses;
    for (int64_t step = 0; step < batches.size(0); ++step) {
      const at::Tensor rows = batches[step].slice(0, first, first + per);
      const at::Tensor loss =
          s->Forward([&] { return model->LossOf(model->forward(rows.slice(1, 0, -1)), rows.slice(1, 1)); });
      s->Backward(loss);
      opt.step();
      opt.zero_grad();
      losses.push_back(s->ReduceMean(loss.item<double>()));
    }
    auto state = s->FullStateDict();
    if (rank == 0) result = {losses, state};
  });
  return result;
}

// ShardTrain against PyTorch (FSDP2, or DTensor TP + FSDP2) from the same
// checkpoint and batches: every loss within 1e-5 and every weight within 1e-5.
int Fit(const std::string& dir, const std::string& reference_path, const FitSetup& setup) {
  constexpr double kTol = 1e-5;
  const HfModelDir hf(dir);
  const trainer::SafetensorsFile ref(reference_path);
  const FitResult ours = FitWith(hf, ref.Tensor("batches"), setup);
  const at::Tensor want = ref.Tensor("losses");
  bool ok = static_cast<int64_t>(ours.losses.size()) == want.numel();
  double loss_diff = 0, weight_diff = 0;
  for (size_t i = 0; ok && i < ours.losses.size(); ++i) {
    loss_diff = std::max(loss_diff, std::abs(ours.losses[i] - want[i].item<double>()));
  }
  for (const auto& [name, tensor] : ours.state) {
    if (!ref.Has("w/" + name)) {
      std::cout << "  FSDP2's state has no " << name << "\n";
      ok = false;
      continue;
    }
    weight_diff = std::max(weight_diff, MaxAbsDiff(tensor, ref.Tensor("w/" + name)));
  }
  std::cout << dir << ": " << setup.label << ", " << ours.losses.size() << " AdamW steps, losses "
            << ours.losses.front() << " -> " << ours.losses.back() << "\n  losses max |diff| " << loss_diff
            << ", weights (" << ours.state.size() << " tensors) max |diff| " << weight_diff << "\n";
  ok = ok && loss_diff <= kTol && weight_diff <= kTol;
  std::cout << (ok ? "  OK\n" : "  FAIL (tolerance 1e-5)\n");
  return ok ? 0 : 1;
}

TEST(LlamaConfigTest, ReadsBothRopeSchemas) {
  const LlamaConfig v5 = ParseLlamaConfig(R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 1, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})",
                                          "v5");
  const LlamaConfig v4 = ParseLlamaConfig(R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 1, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})",
                                          "v4");
  for (const LlamaConfig* c : {&v5, &v4}) {
    EXPECT_EQ(c->rope.type, "llama3");
    EXPECT_EQ(c->rope.theta, 500000.0);
    EXPECT_EQ(c->rope.factor, 8.0);
    EXPECT_EQ(c->rope.original_max_position_embeddings, 64);
    EXPECT_EQ(c->head_dim, 16);
    EXPECT_EQ(c->num_key_value_heads, 1);
  }
  // The exported config reads back as the same model.
  const LlamaConfig back = ParseLlamaConfig(LlamaConfigJson(v4, "float32"), "export");
  EXPECT_EQ(back.ToString(), v4.ToString());
  EXPECT_EQ(back.rope.low_freq_factor, v4.rope.low_freq_factor);
}

TEST(LlamaConfigTest, BadConfigsNameTheKeyAndWhatIsValid) {
  auto error = [](const std::string& json) {
    try {
      ParseLlamaConfig(json, "cfg.json");
    } catch (const InvalidArgumentError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error(R"({"model_type": "gpt2"})").find("model_type \"gpt2\" is not supported (valid: llama)"),
            std::string::npos);
  EXPECT_NE(error(R"({"hidden_size": "64"})").find("\"hidden_size\" must be an integer"), std::string::npos);
  EXPECT_NE(error(R"({"num_attention_heads": 4, "num_key_value_heads": 3})").find("multiple of num_key_value_heads"),
            std::string::npos);
  EXPECT_NE(error(R"({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})").find("valid: default, linear, llama3"),
            std::string::npos);
  EXPECT_NE(error(R"({"hidden_act": "gelu"})").find("valid: silu"), std::string::npos);
  EXPECT_NE(error("{not json").find("cfg.json: not a JSON object"), std::string::npos);
}

TEST(LlamaConfigTest, SizesParseAsTransformersWritesThem) {
  EXPECT_EQ(ParseHfSize("5GB"), 5'000'000'000);
  EXPECT_EQ(ParseHfSize("200MiB"), 200LL << 20);
  EXPECT_EQ(ParseHfSize("123"), 123);
  EXPECT_THROW(ParseHfSize("5 GB"), InvalidArgumentError);
  EXPECT_THROW(ParseHfSize("GB"), InvalidArgumentError);
}

// Under a ZeroInitScope no weight is drawn at random (they are all zero) and
// the generator is untouched; outside it the model is random again.
TEST(LlamaModelTest, ZeroInitScopeDrawsNoRandomWeights) {
  LlamaConfig c;
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 8;
  c.num_hidden_layers = 1;
  c.attention_bias = true;
  torch::manual_seed(5);
  const at::Tensor before = at::rand({1});
  torch::manual_seed(5);
  {
    ZeroInitScope zero_init;
    EXPECT_TRUE(ZeroInitScope::active());
    LlamaForCausalLM model(c);
    for (const auto& p : model->named_parameters()) {
      if (p.key().find("norm") == std::string::npos) {
        EXPECT_EQ(p.value().abs().sum().item<double>(), 0) << p.key();
      }
    }
  }
  EXPECT_TRUE(at::rand({1}).equal(before));  // no random numbers were drawn
  EXPECT_FALSE(ZeroInitScope::active());
  LlamaForCausalLM random(c);
  EXPECT_GT(random->named_parameters()["model.layers.0.mlp.up_proj.weight"].abs().sum().item<double>(), 0);
}

// Logits computed in chunks with a key/value cache equal one full forward.
TEST(LlamaModelTest, CachedChunksEqualOneForward) {
  LlamaConfig c;
  c.vocab_size = 40;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.num_hidden_layers = 2;
  c.initializer_range = 0.2;
  torch::manual_seed(3);
  LlamaForCausalLM model(c);
  at::NoGradGuard no_grad;
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, 9});
  const at::Tensor full = model->forward(ids);
  std::vector<LayerKvCache> cache;
  std::vector<at::Tensor> parts;
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 4}, {4, 5}, {5, 9}}) {
    parts.push_back(model->ForwardWithCache(ids.slice(1, begin, end), cache));
  }
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache[0].length(), 9);
  EXPECT_LE(MaxAbsDiff(at::cat(parts, 1), full), 1e-5);
}

// A hand-written byte-level BPE file: what it encodes, and every part this
// reader does not support refused by name.
TEST(ByteLevelBpeTest, EncodesAndRefusesWhatItDoesNotSupport) {
  const fs::path dir = fs::path(::testing::TempDir()) / "bpe";
  fs::create_directories(dir);
  auto load = [&](const std::string& pre, const std::string& extra) {
    std::ofstream(dir / "tokenizer.json") << R"({"added_tokens": [{"id": 6, "content": "<s>", "rstrip": true}],
        "normalizer": null, "pre_tokenizer": )"
                                          << pre << R"(, "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4, "c": 5},
                  "merges": ["a b", ["Ġ", "ab"]])"
                                          << extra << "}}";
    return LoadTokenizer((dir / "tokenizer.json").string());
  };
  auto error = [&](const std::string& pre, const std::string& extra) {
    try {
      load(pre, extra);
    } catch (const InvalidArgumentError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string byte_level = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
  const auto tok = load(byte_level, "");
  EXPECT_EQ(tok->Encode("ab ab<s>  c"), (std::vector<int64_t>{3, 4, 6, 5}));
  EXPECT_EQ(tok->Decode({3, 4, 6, 5}), "ab ab<s>c");
  EXPECT_EQ(tok->vocab_size(), 7);
  EXPECT_NE(
      error(R"({"type": "Metaspace"})", "").find("pre-tokenizer \"Metaspace\" is not supported (valid: ByteLevel"),
      std::string::npos);
  EXPECT_NE(error(R"({"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"})", "")
                .find("does not compile at offset"),
            std::string::npos);
  EXPECT_NE(error(R"({"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Removed"})", "")
                .find("valid: Isolated, not inverted"),
            std::string::npos);
  EXPECT_NE(error(R"({"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Isolated"})", "")
                .find("has no ByteLevel step"),
            std::string::npos);
  EXPECT_NE(error(byte_level, R"(, "dropout": 0.1)").find("dropout is not supported"), std::string::npos);
  EXPECT_NE(error(byte_level, R"(, "continuing_subword_prefix": "##")").find("valid: null"), std::string::npos);
  std::ofstream(dir / "tokenizer.json") << "{not json";
  EXPECT_THROW(LoadTokenizer((dir / "tokenizer.json").string()), InvalidArgumentError);
}

// One id per byte (ids 10..): enough to see where SftDataset puts each token.
class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int64_t> Encode(const std::string& text) const override {
    std::vector<int64_t> ids;
    for (unsigned char c : text) ids.push_back(10 + c);
    return ids;
  }
  std::string Decode(const std::vector<int64_t>&) const override { return ""; }
  int64_t vocab_size() const override { return 266; }
  int64_t bos_id() const override { return 1; }
  int64_t eos_id() const override { return 2; }
  std::string source() const override { return "bytes"; }
  std::string file() const override { return ""; }
};

TEST(SftDataTest, LossOnCompletionsOnlyPaddedOrPacked) {
  const ByteTokenizer tok;
  const SftSequence s = TokenizeSft(tok, {"ab", "c"}, 1, 2);
  EXPECT_EQ(s.ids, (std::vector<int64_t>{1, 107, 108, 109, 2}));
  EXPECT_EQ(s.labels, (std::vector<int64_t>{-100, -100, -100, 109, 2}));
  const SftSequence longer = TokenizeSft(tok, {"a", "bcd"}, 1, 2);  // 6 tokens
  const SftSequence no_loss = TokenizeSft(tok, {"abcdefgh", "i"}, 1, 2);
  // Padded: a row per example (the one whose completion lies past the block left out), right-padded with id 0.
  const SftDataset padded = SftDataset::Padded({s, longer, no_loss}, /*block=*/5, /*pad_id=*/0);
  ASSERT_EQ(padded.size(), 2);
  const trainer::Batch b = padded.get_batch({0, 1});
  EXPECT_TRUE(b.inputs.equal(at::tensor({1, 107, 108, 109, 0, 1, 107, 108, 109, 110}, at::kLong).view({2, 5})))
      << b.inputs;
  EXPECT_TRUE(b.targets.equal(at::tensor({-100, -100, 109, 2, -100, -100, 108, 109, 110, 2}, at::kLong).view({2, 5})))
      << b.targets;
  EXPECT_EQ(padded.loss_tokens(), 6);
  // Packed: the sequences end to end in windows of block + 1 = 4.
  const SftDataset packed = SftDataset::Packed({s, longer}, /*block=*/3);
  ASSERT_EQ(packed.size(), 2);  // 11 tokens: two windows, the rest dropped
  const trainer::Batch p = packed.get_batch({0, 1});
  EXPECT_TRUE(p.inputs.equal(at::tensor({1, 107, 108, 2, 1, 107}, at::kLong).view({2, 3}))) << p.inputs;
  EXPECT_TRUE(p.targets.equal(at::tensor({-100, -100, 109, -100, -100, 108}, at::kLong).view({2, 3}))) << p.targets;
}

TEST(SftDataTest, BadLinesNameTheLineAndWhatIsValid) {
  const fs::path path = fs::path(::testing::TempDir()) / "sft.jsonl";
  auto error = [&](const std::string& text) {
    std::ofstream(path) << text;
    try {
      ReadSftJsonl(path.string());
    } catch (const InvalidArgumentError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("{\"prompt\": \"a\", \"completion\": \"b\"}\n\n[1]\n").find("sft.jsonl:3: not a JSON object"),
            std::string::npos);
  EXPECT_NE(error("{\"prompt\": \"a\"}\n").find("sft.jsonl:1: \"completion\" is missing"), std::string::npos);
  EXPECT_NE(error("{\"prompt\": 1, \"completion\": \"b\"}\n").find("\"prompt\" is not a string"), std::string::npos);
  EXPECT_NE(error("{\"messages\": []}\n").find("sft.jsonl:1: a chat line needs the checkpoint's chat template"),
            std::string::npos);
  EXPECT_NE(error("\n").find("holds no examples"), std::string::npos);
  std::ofstream(path) << "{\"prompt\": \"a\", \"completion\": \"b\", \"id\": 3}\n";
  EXPECT_EQ(ReadSftJsonl(path.string()).size(), 1u);
}

TEST(SftDataTest, ChatLinesGoThroughTheTemplate) {
  const fs::path path = fs::path(::testing::TempDir()) / "chat.jsonl";
  const ChatTemplate chat(
      "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
      "{{ raise_exception('system goes first') }}{% endif %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}",
      "t.jinja", {{"bos_token", "B"}, {"eos_token", "E"}});
  auto read = [&](const std::string& text, const ChatTemplate* t) {
    std::ofstream(path) << text;
    return ReadSftJsonl(path.string(), [t] { return t; });
  };
  const auto examples = read(R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}
{"prompt": "p", "completion": "c"})",
                             &chat);
  ASSERT_EQ(examples.size(), 3u);
  for (int k : {0, 1}) {
    EXPECT_EQ(examples[k].prompt, "B<user>qE<assistant>");
    EXPECT_EQ(examples[k].completion, "aE");
    EXPECT_TRUE(examples[k].chat);
  }
  EXPECT_FALSE(examples[2].chat);
  // A chat's ids are the template's text alone: no bos/eos around it.
  const ByteTokenizer tok;
  const SftSequence s = TokenizeSft(tok, {"B", "aE", true}, 1, 2);
  EXPECT_EQ(s.ids, (std::vector<int64_t>{10 + 'B', 10 + 'a', 10 + 'E'}));
  EXPECT_EQ(s.labels, (std::vector<int64_t>{-100, 10 + 'a', 10 + 'E'}));
  auto error = [&](const std::string& text, const ChatTemplate* t) {
    try {
      read(text, t);
    } catch (const InvalidArgumentError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string user = R"({"role": "user", "content": "q"})";
  EXPECT_NE(
      error("{\"messages\": [" + user + "]}", &chat).find("chat.jsonl:1: the last message must be the assistant's"),
      std::string::npos);
  EXPECT_NE(error("{\"prompt\": [" + user + "]}", &chat).find("\"completion\" is missing"), std::string::npos);
  EXPECT_NE(error("{\"messages\": [1]}", &chat).find("not an object with a string \"role\""), std::string::npos);
  const std::string system = R"({"role": "system", "content": "s"})",
                    answer = R"({"role": "assistant", "content": "a"})";
  EXPECT_NE(error("{\"messages\": [" + user + ", " + system + ", " + answer + "]}", &chat)
                .find("chat.jsonl:1: t.jinja: line 1: the chat template raised an exception: system goes first"),
            std::string::npos);
  // A template whose generation prompt is not where the answer starts.
  const ChatTemplate odd("{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}",
                         "odd.jinja", {});
  EXPECT_NE(error("{\"messages\": [" + user + ", " + answer + "]}", &odd)
                .find("odd.jinja renders the whole conversation as a text that does not begin with"),
            std::string::npos);
}

class HfCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    config_.vocab_size = 32;
    config_.hidden_size = 16;
    config_.intermediate_size = 24;
    config_.num_hidden_layers = 2;
    config_.num_attention_heads = 2;
    config_.num_key_value_heads = 1;
    config_.head_dim = 8;
  }
  void Write(const std::string& name, const std::string& text) const { std::ofstream(dir_ / name) << text; }
  std::string LoadError() const {
    try {
      HfModelDir hf(dir_.string());
      LlamaForCausalLM model(hf.config);
      LoadHfWeights(*model, hf.config, hf.weights);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  }
  fs::path dir_;
  LlamaConfig config_;
};

TEST_F(HfCheckpointTest, ShardedSaveLoadsBitForBit) {
  LlamaForCausalLM model(config_);
  HfSaveOptions options;
  options.max_shard_bytes = 2000;  // several files
  const auto files = SaveHfModel(dir_.string(), config_, *model, options);
  ASSERT_GT(files.size(), 4u);
  ASSERT_TRUE(fs::exists(dir_ / kHfIndexFile));
  LlamaForCausalLM back(ParseLlamaConfig(LlamaConfigJson(config_, "float32"), "export"));
  LoadHfWeights(*back, config_, HfWeights(dir_.string()));
  for (const auto& p : model->named_parameters()) EXPECT_TRUE(p.value().equal(back->named_parameters()[p.key()]));
  // A smaller save into the same directory replaces the shards and the index.
  options.max_shard_bytes = 1'000'000;
  SaveHfModel(dir_.string(), config_, *model, options);
  EXPECT_FALSE(fs::exists(dir_ / kHfIndexFile));
  EXPECT_FALSE(fs::exists(dir_ / "model-00001-of-00002.safetensors"));
  EXPECT_EQ(HfWeights(dir_.string()).names().size(), model->named_parameters().size());
}

TEST_F(HfCheckpointTest, MalformedDirectoriesNameWhatIsWrong) {
  fs::create_directories(dir_);
  Write("config.json", LlamaConfigJson(config_, "float32"));
  EXPECT_NE(LoadError().find("holds no Hugging Face weights"), std::string::npos);
  Write(kHfIndexFile, R"({"weight_map": {"model.norm.weight": "../x.safetensors"}})");
  EXPECT_NE(LoadError().find("is not a file name inside the directory"), std::string::npos);
  Write(kHfIndexFile, R"({"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}})");
  EXPECT_NE(LoadError().find("which is not in"), std::string::npos);
  fs::remove(dir_ / kHfIndexFile);
  // A checkpoint of another shape: every difference is named.
  LlamaConfig other = config_;
  other.intermediate_size = 20;
  other.tie_word_embeddings = true;
  LlamaForCausalLM model(other);
  SaveHfModel(dir_.string(), other, *model, HfSaveOptions());
  Write("config.json", LlamaConfigJson(config_, "float32"));
  const std::string e = LoadError();
  EXPECT_NE(e.find("missing: lm_head.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("other shape: model.layers.0.mlp.down_proj.weight ([16, 20] in"), std::string::npos) << e;
}

// Every strategy at W=2 (threads-as-ranks, real Gloo) loads a sharded
// Hugging Face directory into its wrapped model: the full state equals the
// saved tensors bit for bit and the logits equal the unsharded model's.
TEST_F(HfCheckpointTest, StrategiesLoadTheirShardsFromTheFiles) {
  config_.tie_word_embeddings = false;
  config_.num_hidden_layers = 3;
  config_.initializer_range = 0.2;
  torch::manual_seed(7);
  LlamaForCausalLM reference(config_);
  HfSaveOptions options;
  options.max_shard_bytes = 3000;  // ranges cross files
  SaveHfModel(dir_.string(), config_, *reference, options);
  const at::Tensor ids = at::randint(0, config_.vocab_size, {2, 7});
  at::Tensor want;
  {
    at::NoGradGuard no_grad;
    want = reference->forward(ids);
  }
  for (const std::string name : {"fsdp_native", "fsdp", "ddp"}) {
    SCOPED_TRACE(name);
    constexpr int kWorld = 2;
    std::vector<LlamaForCausalLM> models;
    for (int r = 0; r < kWorld; ++r) models.emplace_back(config_);  // other random weights
    const HfWeights weights(dir_.string());
    std::vector<at::Tensor> logits(kWorld);
    std::map<std::string, at::Tensor> state;
    testing::RunRanks(kWorld, [&](int rank, const auto& comm) {
      auto s = strategies::StrategyRegistry::Create(name, {});
      s->Setup(comm, ClusterInfo());
      s->WrapModel(models[rank].ptr());
      s->module().eval();
      LoadHfWeightsInto(*s, config_, weights);
      auto full = s->FullStateDict();
      if (rank == 0) state = full;
      at::NoGradGuard no_grad;
      logits[rank] = s->Forward([&] { return models[rank]->forward(ids); });
    });
    ASSERT_EQ(state.size(), reference->named_parameters().size());
    for (const auto& p : reference->named_parameters()) {
      ASSERT_TRUE(state.count(p.key())) << p.key();
      EXPECT_TRUE(state[p.key()].equal(p.value())) << p.key();
    }
    for (const at::Tensor& l : logits) EXPECT_LE(MaxAbsDiff(l, want), 1e-5);
  }
}

}  // namespace
}  // namespace shardtrain::examples::llama

int main(int argc, char** argv) {
  using namespace shardtrain::examples::llama;
  try {
    if (argc == 4 && std::strcmp(argv[1], "check") == 0) return Check(argv[2], argv[3]);
    if (argc == 4 && std::strcmp(argv[1], "fit") == 0) {
      return Fit(argv[2], argv[3],
                 {"fsdp_native W=2 vs PyTorch FSDP2", "fsdp_native", {{"sharding_strategy", "FULL_SHARD"}}, 2});
    }
    if (argc == 4 && std::strcmp(argv[1], "fit-tp") == 0) {
      return Fit(argv[2], argv[3],
                 {"model_parallel 2x2 vs PyTorch DTensor TP x FSDP2 2x2",
                  "model_parallel",
                  {{"data_parallel_size", "2"}, {"tensor_parallel_size", "2"}},
                  4});
    }
    if (argc == 6 && std::strcmp(argv[1], "export") == 0) return Export(argv[2], argv[3], argv[4], argv[5]);
    if (argc >= 5 && std::strcmp(argv[1], "tokenize") == 0) {
      return Tokenize(argv[2], argv[3], std::vector<std::string>(argv + 4, argv + argc));
    }
  } catch (const std::exception& e) {
    std::cerr << "llama_test " << argv[1] << ": " << e.what() << "\n";
    return 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
