// examples/llama: a Llama-family model trained by the Trainer with any
// registered strategy (default fsdp_native: FULL_SHARD over 2 CPU ranks, one
// FSDP unit per decoder layer), from scratch or from a Hugging Face directory.
//
//   tools/bazel run //examples/llama:train
//   tools/bazel run //examples/llama:train -- --save_hf=/tmp/llama-hf
//   tools/bazel run //examples/llama:train -- --hf_checkpoint=/tmp/llama-hf --max_steps=100 --lr=3e-4
//
// From scratch, the text (--data, default Debian's fortunes) is tokenized by
// a SentencePiece BPE model of --vocab_size pieces trained on it and cached
// in --tokenizer_cache_dir. With --hf_checkpoint=DIR the model's shape comes
// from DIR/config.json, its weights stream into each rank's shards, and the
// tokenizer is DIR/tokenizer.model, else DIR/tokenizer.json (or --tokenizer:
// SentencePiece or byte-level BPE). 90% of the tokens train
// (windows of --block_size, reshuffled every epoch), 10% validate. Prints
// progress, the validation loss before, during and after training and a
// sample; --save_hf=DIR writes a Hugging Face directory at the end (with the
// tokenizer), which Python `transformers` loads. --sft_data=FILE fine-tunes on
// prompt/completion pairs (JSON Lines) instead of the text: the loss is taken
// on the completions only, batches are padded (or packed, --sft_packing), and
// the last 10% of the examples validate. Chat lines ("messages", or "prompt"
// and "completion" as lists of messages) are rendered by the checkpoint's
// chat template (chat_template.jinja or tokenizer_config.json's, as
// transformers' apply_chat_template renders them), with the loss on the final
// assistant turn.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>

#include "base/errors.h"
#include "examples/common/example_util.h"
#include "examples/common/flag_checks.h"
#include "examples/common/lm_common.h"
#include "examples/common/lm_flags.h"
#include "examples/common/trainer_flags.h"
#include "examples/llama/hf_checkpoint.h"
#include "examples/llama/hf_strategy_io.h"
#include "examples/llama/llama_model.h"
#include "examples/llama/sft_data.h"
#include "examples/llama/tokenizer.h"
#include "trainer/trainer.h"

DEFINE_string(hf_checkpoint, "", "fine-tune from this Hugging Face model directory (config.json + safetensors)");
DEFINE_string(tokenizer, "",
              "a SentencePiece tokenizer.model or a byte-level BPE tokenizer.json (default: the checkpoint's, or one "
              "trained on the text)");
DEFINE_int64(vocab_size, 1024, "pieces of the tokenizer trained on the text (from scratch, without --tokenizer)");
DEFINE_string(tokenizer_cache_dir, "", "where trained tokenizers are kept (default: ~/.cache/shardtrain/tokenizers)");
DEFINE_int32(hidden_size, 128, "from scratch: hidden size");
DEFINE_int32(intermediate_size, 352, "from scratch: SwiGLU MLP width");
DEFINE_int32(num_layers, 4, "from scratch: decoder layers (one FSDP unit each)");
DEFINE_int32(num_heads, 4, "from scratch: attention heads");
DEFINE_int32(num_kv_heads, 2, "from scratch: key/value heads (a divisor of --num_heads; 1: multi-query)");
DEFINE_bool(tie_word_embeddings, false, "from scratch: tie the output head to the token embedding");
DEFINE_string(save_hf, "", "write a Hugging Face model directory here at the end");
DEFINE_string(save_hf_dtype, "bf16", "dtype of --save_hf's weights: bf16 or fp32");
DEFINE_string(save_hf_max_shard_size, "50GB", "split --save_hf's weights into files of at most this size");
DEFINE_string(sft_data, "",
              "fine-tune on prompt/completion pairs from this JSON Lines file (loss on the completions only) instead "
              "of --data's text; chat lines ({\"messages\": [...]}) go through --hf_checkpoint's chat template");
DEFINE_bool(sft_packing, false,
            "with --sft_data: pack the examples into windows of --block_size instead of one padded row each");
DEFINE_double(top_p, 1.0, "sample from the smallest set of tokens with this probability (1: all)");

namespace {

using namespace shardtrain;
using examples::Fmt;
using examples::PrintLine;
using examples::llama::LlamaConfig;

class LlamaModule : public trainer::TrainingModule {
 public:
  LlamaModule(LlamaConfig config, examples::LmOptimizerOptions optim, std::string hf_dir)
      : config_(std::move(config)), optim_(std::move(optim)), hf_dir_(std::move(hf_dir)) {}

  std::shared_ptr<torch::nn::Module> configure_model() override {
    // Fine-tuning: no random initialization of weights the load replaces.
    std::optional<examples::llama::ZeroInitScope> zero_init;
    if (!hf_dir_.empty()) zero_init.emplace();
    model_ = std::make_shared<examples::llama::LlamaForCausalLMImpl>(config_);
    return model_;
  }
  // Fine-tuning: each rank streams its shards' ranges from the files.
  void on_model_wrapped() override {
    if (hf_dir_.empty()) return;
    const auto t0 = std::chrono::steady_clock::now();
    examples::llama::LoadHfWeightsInto(strategy(), config_, examples::llama::HfWeights(hf_dir_));
    if (strategy().rank() == 0) {
      PrintLine("loaded " + hf_dir_ +
                Fmt(" in %.1f s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()));
    }
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    return model_->LossOf(forward([&] { return model_->forward(b.inputs); }), b.targets);
  }
  std::optional<at::Tensor> validation_step(const trainer::Batch& b, int64_t i) override { return training_step(b, i); }
  trainer::OptimizerConfig configure_optimizers(const std::vector<at::Tensor>& params) override {
    return examples::MakeLmOptimizer(params, optim_);
  }
  shardtrain::trainer::StateDict hyper_parameters() const override {
    return {{"model", "llama"},
            {"vocab_size", config_.vocab_size},
            {"hidden_size", config_.hidden_size},
            {"intermediate_size", config_.intermediate_size},
            {"num_hidden_layers", config_.num_hidden_layers},
            {"num_attention_heads", config_.num_attention_heads},
            {"num_key_value_heads", config_.num_key_value_heads},
            {"head_dim", config_.head_dim},
            {"tie_word_embeddings", config_.tie_word_embeddings},
            {"hf_checkpoint", hf_dir_},
            {"lr", optim_.lr},
            {"weight_decay", optim_.weight_decay},
            {"lr_scheduler", optim_.schedule},
            {"warmup_steps", optim_.ResolvedWarmup()}};
  }
  // Decodes `n` tokens after `prompt` ([1, T]) with a key/value cache (a
  // tensor-parallel model: the whole sequence each step, the vocabulary's
  // logits gathered). Collective: every rank calls it with the same prompt
  // and seed, and each step's forward goes through the strategy (sharded
  // layers gather).
  at::Tensor Generate(at::Tensor ids, const examples::llama::GenerateOptions& o) {
    at::NoGradGuard no_grad;
    model_->eval();
    at::Generator gen = at::detail::createCPUGenerator(o.seed);
    std::vector<examples::llama::LayerKvCache> cache;
    at::Tensor input = ids;
    const at::Device device = trainer().device();
    for (int64_t i = 0; i < o.max_new_tokens && ids.size(1) < config_.max_position_embeddings; ++i) {
      at::Tensor logits = model_->tensor_parallel()
                              ? model_->GatherLogits(forward([&] { return model_->forward(ids.to(device)); }))
                              : forward([&] { return model_->ForwardWithCache(input.to(device), cache); });
      at::Tensor next =
          examples::llama::PickNextToken(logits.select(1, logits.size(1) - 1).to(at::kFloat).cpu(), o, gen);
      input = next.unsqueeze(1);
      ids = at::cat({ids, input}, 1);
      if (!config_.eos_token_ids.empty() && next.item<int64_t>() == config_.eos_token_ids[0]) break;
    }
    model_->train();
    return ids;
  }
  // The full state, one unit at a time, into a Hugging Face directory (rank 0 writes).
  void SaveHf(const std::string& dir, const examples::llama::HfSaveOptions& o) {
    examples::llama::SaveHfModel(strategy(), dir, config_, o);
  }

 private:
  LlamaConfig config_;
  examples::LmOptimizerOptions optim_;
  std::string hf_dir_;
  std::shared_ptr<examples::llama::LlamaForCausalLMImpl> model_;
};

void CheckFlags() {
  using examples::CheckDoubleFlag;
  using examples::CheckIntFlag;
  examples::CheckLmFlags();
  CheckIntFlag("vocab_size", FLAGS_vocab_size, 260, 1 << 20);
  CheckIntFlag("hidden_size", FLAGS_hidden_size, 1, 1 << 16);
  CheckIntFlag("intermediate_size", FLAGS_intermediate_size, 1, 1 << 18);
  CheckIntFlag("num_layers", FLAGS_num_layers, 1, 1024);
  CheckIntFlag("num_heads", FLAGS_num_heads, 1, 1024);
  CheckIntFlag("num_kv_heads", FLAGS_num_kv_heads, 1, FLAGS_num_heads);
  if (FLAGS_hidden_size % FLAGS_num_heads != 0 || (FLAGS_hidden_size / FLAGS_num_heads) % 2 != 0) {
    examples::FailFlag("num_heads", std::to_string(FLAGS_num_heads),
                       "a divisor of --hidden_size=" + std::to_string(FLAGS_hidden_size) + " giving even head sizes",
                       "rotary embeddings rotate pairs of each head's dimensions");
  }
  if (FLAGS_num_heads % FLAGS_num_kv_heads != 0) {
    examples::FailFlag("num_kv_heads", std::to_string(FLAGS_num_kv_heads),
                       "a divisor of --num_heads=" + std::to_string(FLAGS_num_heads),
                       "query heads share key/value heads evenly");
  }
  examples::CheckChoiceFlag("save_hf_dtype", FLAGS_save_hf_dtype, {"bf16", "fp32"});
  try {
    examples::llama::ParseHfSize(FLAGS_save_hf_max_shard_size);
  } catch (const InvalidArgumentError&) {
    examples::FailFlag("save_hf_max_shard_size", FLAGS_save_hf_max_shard_size,
                       "a positive size: bytes, or a number followed by B, KB, MB, GB, KiB, MiB or GiB", "");
  }
  CheckDoubleFlag("top_p", FLAGS_top_p, 0, 1, /*min_open=*/true);
  if (!FLAGS_sft_data.empty() && !std::filesystem::is_regular_file(examples::UserPath(FLAGS_sft_data))) {
    examples::FailFlag("sft_data", FLAGS_sft_data,
                       "a readable JSON Lines file of {\"prompt\": ..., \"completion\": ...}", "no such file");
  }
  if (FLAGS_sft_packing && FLAGS_sft_data.empty()) {
    examples::FailFlag("sft_packing", "true", "false without --sft_data", "only fine-tuning examples are packed");
  }
}

// The model from --hf_checkpoint's config.json, or from the flags.
LlamaConfig ModelConfig(int64_t vocab_size, int64_t bos, int64_t eos) {
  if (!FLAGS_hf_checkpoint.empty()) {
    return examples::llama::ReadLlamaConfig(
        (std::filesystem::path(examples::UserPath(FLAGS_hf_checkpoint)) / "config.json").string());
  }
  LlamaConfig c;
  c.vocab_size = vocab_size;
  c.hidden_size = FLAGS_hidden_size;
  c.intermediate_size = FLAGS_intermediate_size;
  c.num_hidden_layers = FLAGS_num_layers;
  c.num_attention_heads = FLAGS_num_heads;
  c.num_key_value_heads = FLAGS_num_kv_heads;
  c.head_dim = FLAGS_hidden_size / FLAGS_num_heads;
  c.max_position_embeddings = std::max<int64_t>(FLAGS_block_size, 256);
  c.tie_word_embeddings = FLAGS_tie_word_embeddings;
  c.bos_token_id = bos;
  if (eos >= 0) c.eos_token_ids = {eos};
  c.Validate();
  return c;
}

// --tokenizer, the checkpoint's tokenizer (tokenizer.model or tokenizer.json),
// or one trained on the text.
std::unique_ptr<examples::llama::Tokenizer> MakeTokenizer(const std::string& text) {
  std::string path = examples::UserPath(FLAGS_tokenizer);
  if (path.empty() && !FLAGS_hf_checkpoint.empty()) {
    path = examples::llama::FindTokenizerFile(examples::UserPath(FLAGS_hf_checkpoint));
    ST_CHECK_ARG(!path.empty(), "--hf_checkpoint=", FLAGS_hf_checkpoint,
                 " has no tokenizer.model (SentencePiece) or tokenizer.json (byte-level BPE); give one with "
                 "--tokenizer=FILE");
  }
  if (path.empty()) {
    std::string cache = examples::UserPath(FLAGS_tokenizer_cache_dir);
    if (cache.empty()) {
      const char* home = std::getenv("HOME");
      cache = std::string(home != nullptr ? home : ".") + "/.cache/shardtrain/tokenizers";
    }
    path = examples::llama::TrainSentencePiece(text, FLAGS_vocab_size, cache);
  }
  return examples::llama::LoadTokenizer(path);
}

// The chat template of --hf_checkpoint's directory (else --tokenizer's),
// loaded when --sft_data's first chat line asks for it.
std::function<const examples::llama::ChatTemplate*()> ChatTemplateGetter(bool rank0) {
  struct State {
    bool loaded = false;
    std::optional<examples::llama::ChatTemplate> chat;
  };
  auto state = std::make_shared<State>();
  return [state, rank0]() -> const examples::llama::ChatTemplate* {
    if (!state->loaded) {
      state->loaded = true;
      std::string dir = examples::UserPath(FLAGS_hf_checkpoint);
      if (dir.empty() && !FLAGS_tokenizer.empty())
        dir = std::filesystem::path(examples::UserPath(FLAGS_tokenizer)).parent_path().string();
      if (!dir.empty()) state->chat = examples::llama::LoadChatTemplate(dir);
      if (rank0 && state->chat) PrintLine("chat template " + state->chat->origin());
    }
    return state->chat ? &*state->chat : nullptr;
  };
}

// Chat examples hold the template's special tokens as text: only a tokenizer
// that splits added tokens out of the text (tokenizer.json) encodes them as
// transformers does.
void CheckChatTokenizer(const std::vector<examples::llama::SftExample>& sft, const examples::llama::Tokenizer& tok) {
  const bool chats = std::any_of(sft.begin(), sft.end(), [](const auto& e) { return e.chat; });
  const std::string& file = tok.file();
  ST_CHECK_ARG(!chats || (file.size() >= 5 && file.compare(file.size() - 5, 5, ".json") == 0),
               "--sft_data=", FLAGS_sft_data, " holds chats, whose templates write special tokens as text; the ",
               "tokenizer ", tok.source(), " does not split them out (valid: a byte-level BPE tokenizer.json, as ",
               "--tokenizer=FILE or in --hf_checkpoint's directory without a tokenizer.model)");
}

// What a run trains and validates on, and the prompt its sample continues.
struct RunData {
  std::unique_ptr<trainer::Dataset> train, val;
  at::Tensor prompt;  // [1, T]
  std::string summary;
};

// Windows of the text's tokens: 90% train (tiled), 10% validate.
RunData TextData(const examples::llama::Tokenizer& tok, const std::string& text) {
  at::Tensor all = at::tensor(tok.Encode(text), at::kLong);
  const int64_t n = all.numel() * 9 / 10;
  ST_CHECK_ARG(all.numel() - n > FLAGS_block_size + 1, "the text is too short for --block_size=", FLAGS_block_size,
               " (", all.numel() - n, " validation tokens)");
  const at::Tensor train = all.slice(0, 0, n), val = all.slice(0, n);
  RunData d;
  d.train = std::make_unique<examples::WindowDataset>(examples::WindowDataset::Tiled(train, FLAGS_block_size));
  d.val = std::make_unique<examples::WindowDataset>(
      examples::WindowDataset::Spread(val, FLAGS_block_size, FLAGS_val_samples));
  d.prompt = val.slice(0, 0, std::min<int64_t>(8, FLAGS_block_size)).unsqueeze(0);
  d.summary = std::to_string(train.numel()) + "+" + std::to_string(val.numel()) + " tokens";
  return d;
}

// --sft_data's examples: the last 10% (at least 1, at most --val_samples)
// validate, padded; the rest train, padded or packed (--sft_packing).
RunData SftData(const examples::llama::Tokenizer& tok, const std::vector<examples::llama::SftExample>& examples,
                const LlamaConfig& cfg) {
  using examples::llama::SftDataset;
  ST_CHECK_ARG(examples.size() >= 2, "--sft_data=", FLAGS_sft_data, " holds ", examples.size(),
               " example(s); at least 2 are needed (one to train on, one to validate)");
  const int64_t bos = cfg.bos_token_id, eos = cfg.eos_token_ids.empty() ? -1 : cfg.eos_token_ids[0];
  const size_t n_val = std::min<size_t>(FLAGS_val_samples, std::max<size_t>(1, examples.size() / 10));
  std::vector<examples::llama::SftSequence> train, val;
  for (size_t i = 0; i < examples.size(); ++i) {
    (i + n_val < examples.size() ? train : val).push_back(examples::llama::TokenizeSft(tok, examples[i], bos, eos));
  }
  const int64_t pad = eos >= 0 ? eos : 0;
  auto t = std::make_unique<SftDataset>(FLAGS_sft_packing ? SftDataset::Packed(train, FLAGS_block_size)
                                                          : SftDataset::Padded(train, FLAGS_block_size, pad));
  auto v = std::make_unique<SftDataset>(SftDataset::Padded(val, FLAGS_block_size, pad));
  RunData d;
  const examples::llama::SftExample& first_val = examples[examples.size() - n_val];
  std::vector<int64_t> prompt = tok.Encode(first_val.prompt);
  if (bos >= 0 && !first_val.chat) prompt.insert(prompt.begin(), bos);
  d.prompt = at::tensor(prompt, at::kLong).unsqueeze(0);
  const auto chats = std::count_if(examples.begin(), examples.end(), [](const auto& e) { return e.chat; });
  d.summary = std::to_string(train.size()) + "+" + std::to_string(val.size()) + " fine-tuning examples (" +
              (chats > 0 ? std::to_string(chats) + " chats; " : "") +
              (FLAGS_sft_packing ? "packed into " : "padded, ") + std::to_string(t->size()) + " rows; " +
              std::to_string(t->loss_tokens()) + "+" + std::to_string(v->loss_tokens()) + " completion tokens)";
  d.train = std::move(t);
  d.val = std::move(v);
  return d;
}

// Generates after `prompt`; every rank runs it.
std::string Sample(LlamaModule& module, const examples::llama::Tokenizer& tok, const at::Tensor& prompt) {
  examples::llama::GenerateOptions g;
  g.max_new_tokens = FLAGS_sample_tokens;
  g.temperature = FLAGS_temperature;
  g.top_k = FLAGS_top_k;
  g.top_p = FLAGS_top_p;
  g.seed = FLAGS_seed;
  at::Tensor ids = module.Generate(prompt, g)[0];
  return tok.Decode(std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel()));
}

void SaveHfAtEnd(LlamaModule& module, const examples::llama::Tokenizer& tok, bool rank0) {
  const std::string dir = examples::UserPath(FLAGS_save_hf);
  examples::llama::HfSaveOptions o;
  o.dtype = FLAGS_save_hf_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  o.max_shard_bytes = examples::llama::ParseHfSize(FLAGS_save_hf_max_shard_size);
  const auto t0 = std::chrono::steady_clock::now();
  module.SaveHf(dir, o);
  if (!rank0) return;
  examples::llama::CopyTokenizerFiles(tok, dir);
  PrintLine("wrote Hugging Face directory " + dir +
            Fmt(" in %.1f s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()));
}

int Run() {
  const auto t_start = std::chrono::steady_clock::now();
  trainer::TrainerOptions o;
  const examples::ProcessPlan plan = examples::ApplyTrainerFlags(o);
  const bool rank0 = plan.rank == 0;
  std::vector<examples::llama::SftExample> sft;
  std::string text;
  if (FLAGS_sft_data.empty()) {
    text = examples::ReadCorpus(examples::UserPath(FLAGS_data));
  } else {  // the examples' text trains a tokenizer from scratch
    sft = examples::llama::ReadSftJsonl(examples::UserPath(FLAGS_sft_data), ChatTemplateGetter(rank0));
    for (const auto& e : sft) text += e.prompt + e.completion + "\n";
  }
  const auto tok = MakeTokenizer(text);
  CheckChatTokenizer(sft, *tok);
  const LlamaConfig cfg = ModelConfig(tok->vocab_size(), tok->bos_id(), tok->eos_id());
  ST_CHECK_ARG(cfg.vocab_size >= tok->vocab_size(), "the model's vocabulary (", cfg.vocab_size,
               ") is smaller than the tokenizer's (", tok->vocab_size(), ", ", tok->source(), ")");
  const RunData data = sft.empty() ? TextData(*tok, text) : SftData(*tok, sft, cfg);

  examples::ApplyLmFlags(o);
  auto printer = std::make_shared<examples::ValLossPrinter>();
  o.callbacks = {printer};
  const std::string ckpt = examples::ResolveCheckpointPath(FLAGS_ckpt_path, o.default_root_dir, o.logger_name);
  trainer::Trainer trainer(o);
  LlamaModule module(cfg, examples::LmOptimizerFromFlags(), examples::UserPath(FLAGS_hf_checkpoint));
  if (rank0) {
    std::printf("ShardTrain Llama: %s, strategy %s%s%s, %d rank(s), %s, batch %ld x %d, tokenizer %s, %s\n",
                cfg.ToString().c_str(), FLAGS_strategy.c_str(), FLAGS_strategy_options.empty() ? "" : " ",
                FLAGS_strategy_options.c_str(), plan.devices * plan.num_nodes, FLAGS_precision.c_str(),
                static_cast<long>(FLAGS_batch_size), plan.devices * plan.num_nodes, tok->source().c_str(),
                data.summary.c_str());
    if (!ckpt.empty()) std::printf("resuming from %s\n", ckpt.c_str());
    std::fflush(stdout);
  }
  const examples::LmRunResult r = examples::FitWithValidation(trainer, module, *data.train, *data.val, ckpt, *printer);
  const std::string sample = FLAGS_sample_tokens > 0 ? Sample(module, *tok, data.prompt) : "";
  if (!FLAGS_save_hf.empty()) SaveHfAtEnd(module, *tok, rank0);
  if (rank0) {
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::printf("validation loss: %.4f -> %.4f; %ld steps; fit %.0f s, total %.0f s\n", r.first_val, r.last_val,
                static_cast<long>(trainer.step_losses().size()), r.fit_secs, total);
    if (!sample.empty()) std::printf("--- sample ---\n%s\n--------------\n", sample.c_str());
    examples::PrintOutputPaths(trainer);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return shardtrain::examples::RunExampleMain(
      argc, argv, "train a Llama-family model with the ShardTrain Trainer: train --strategy=fsdp_native --devices=2",
      Run, CheckFlags);
}
