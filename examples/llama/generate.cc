// examples/llama: text from a Hugging Face Llama directory, on one process.
//
//   tools/bazel run //examples/llama:generate -- --hf_checkpoint=DIR --prompt="Once upon a time"
//   tools/bazel run //examples/llama:generate -- --hf_checkpoint=DIR --prompt_ids=1,2,3 --greedy --print_ids
//
// The prompt is text (encoded with DIR/tokenizer.model, DIR/tokenizer.json or
// --tokenizer, config.json's beginning-of-sequence id first as Hugging Face's
// Llama tokenizers do) or token ids. Decoding uses a key/value cache; greedy
// (--greedy) or sampled with temperature, top-k and top-p from --seed. Prints
// the text (when there is a tokenizer) and, with --print_ids, the ids of
// prompt and continuation.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gflags/gflags.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "base/errors.h"
#include "examples/llama/hf_checkpoint.h"
#include "examples/llama/llama_model.h"
#include "examples/llama/tokenizer.h"

DEFINE_string(hf_checkpoint, "", "the Hugging Face model directory (config.json + safetensors); required");
DEFINE_string(prompt, "", "the prompt as text (needs a tokenizer)");
DEFINE_string(prompt_ids, "", "the prompt as comma-separated token ids (instead of --prompt)");
DEFINE_string(tokenizer, "", "a SentencePiece tokenizer.model or a tokenizer.json (default: the checkpoint's)");
DEFINE_bool(add_bos, true, "with --prompt: put the beginning-of-sequence id first");
DEFINE_int32(max_new_tokens, 64, "tokens to generate at most (fewer when an end-of-sequence id comes)");
DEFINE_bool(greedy, false, "take the most likely token each step instead of sampling");
DEFINE_double(temperature, 0.8, "sampling temperature (> 0)");
DEFINE_int32(top_k, 0, "sample from the k most likely tokens (0: all)");
DEFINE_double(top_p, 1.0, "sample from the smallest set of tokens with this probability, in (0, 1]");
DEFINE_uint64(seed, 1337, "the sampler's seed");
DEFINE_bool(print_ids, false, "also print the ids, prompt and continuation, on one line");

namespace {

using namespace shardtrain;
using namespace shardtrain::examples::llama;

std::vector<int64_t> ParseIds(const std::string& text, int64_t vocab) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    ST_CHECK_ARG(used == item.size() && id >= 0 && id < vocab, "--prompt_ids: '", item,
                 "' is not a token id (valid: integers in [0, ", vocab, "), comma-separated)");
    ids.push_back(id);
  }
  ST_CHECK_ARG(!ids.empty(), "--prompt_ids is empty");
  return ids;
}

std::unique_ptr<Tokenizer> MaybeTokenizer() {
  std::string path = FLAGS_tokenizer;
  if (path.empty()) path = FindTokenizerFile(FLAGS_hf_checkpoint);
  if (!std::filesystem::is_regular_file(path)) {
    ST_CHECK_ARG(FLAGS_tokenizer.empty(), "--tokenizer=", FLAGS_tokenizer, " is not a file");
    return nullptr;
  }
  return LoadTokenizer(path);
}

int Run() {
  ST_CHECK_ARG(!FLAGS_hf_checkpoint.empty(), "give --hf_checkpoint=DIR (a Hugging Face model directory)");
  ST_CHECK_ARG(FLAGS_prompt.empty() != FLAGS_prompt_ids.empty(), "give one of --prompt=TEXT and --prompt_ids=1,2,3");
  ST_CHECK_ARG(FLAGS_max_new_tokens >= 0, "--max_new_tokens=", FLAGS_max_new_tokens, " must be >= 0");
  HfModelDir hf(FLAGS_hf_checkpoint);
  LlamaForCausalLM model = [&] {
    ZeroInitScope zero_init;  // every weight is loaded next
    return LlamaForCausalLM(hf.config);
  }();
  LoadHfWeights(*model, hf.config, hf.weights);
  model->eval();
  const auto tok = MaybeTokenizer();
  std::vector<int64_t> prompt;
  if (!FLAGS_prompt_ids.empty()) {
    prompt = ParseIds(FLAGS_prompt_ids, hf.config.vocab_size);
  } else {
    ST_CHECK_ARG(tok != nullptr, FLAGS_hf_checkpoint, " has no tokenizer.model: give --tokenizer=FILE or --prompt_ids");
    if (FLAGS_add_bos && hf.config.bos_token_id >= 0) prompt.push_back(hf.config.bos_token_id);
    for (int64_t id : tok->Encode(FLAGS_prompt)) prompt.push_back(id);
  }
  GenerateOptions o;
  o.max_new_tokens = FLAGS_max_new_tokens;
  o.greedy = FLAGS_greedy;
  o.temperature = FLAGS_temperature;
  o.top_k = FLAGS_top_k;
  o.top_p = FLAGS_top_p;
  o.seed = FLAGS_seed;
  const at::Tensor out = model->Generate(at::tensor(prompt, at::kLong).unsqueeze(0), o)[0];
  const std::vector<int64_t> ids(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
  if (tok != nullptr) {
    std::printf("%s\n", tok->Decode(std::vector<int64_t>(ids.begin() + (FLAGS_add_bos && !FLAGS_prompt.empty() &&
                                                                        hf.config.bos_token_id >= 0),
                                                         ids.end()))
                            .c_str());
  }
  if (FLAGS_print_ids) {
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) line += (i ? "," : "") + std::to_string(ids[i]);
    std::printf("ids: %s\n", line.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("generate text from a Hugging Face Llama: generate --hf_checkpoint=DIR --prompt=TEXT");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  try {
    return Run();
  } catch (const shardtrain::InvalidArgumentError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
