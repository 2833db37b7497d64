// The configuration of a Llama-family decoder, as Hugging Face's
// `config.json` (model_type "llama") gives it.
//
// Both schemas that `transformers` writes are read: the 4.x one (top-level
// `rope_theta`, `rope_scaling: {"rope_type" | "type": ...}`) and the 5.x one
// (`rope_parameters: {"rope_type", "rope_theta", ...}`). Keys the model does
// not use are ignored; a key it uses with a wrong type or value, or a
// combination that cannot build a model (heads that do not divide, an
// unknown rope type or activation) stops with an error naming the file, the
// key and what is valid.
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_CONFIG_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::examples::llama {

// Rotary position embeddings: "default", "linear" (positions divided by
// `factor`) or "llama3" (Llama 3.1's frequency-dependent scaling).
struct RopeConfig {
  std::string type = "default";
  double theta = 10000.0;
  double factor = 1.0;
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  int64_t original_max_position_embeddings = 0;  // llama3
};

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 128;
  int64_t intermediate_size = 352;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 4;  // 1 = multi-query; < heads = grouped-query
  int64_t head_dim = 32;            // hidden_size / heads unless the config says
  int64_t max_position_embeddings = 256;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool attention_bias = false;
  bool mlp_bias = false;
  bool tie_word_embeddings = false;
  std::string hidden_act = "silu";
  double initializer_range = 0.02;
  int64_t bos_token_id = -1;  // -1: none
  int64_t pad_token_id = -1;
  std::vector<int64_t> eos_token_ids;

  // Throws InvalidArgumentError naming the first field that cannot build a
  // model and what is valid.
  void Validate() const;
  // Parameters of the model this configuration builds (a tied head counted once).
  int64_t NumParameters() const;
  std::string ToString() const;
};

// Parses the text of a config.json; `where` names it in errors (throws
// shardtrain::InvalidArgumentError).
LlamaConfig ParseLlamaConfig(const std::string& json_text, const std::string& where);
// Reads and parses the file at `path`.
LlamaConfig ReadLlamaConfig(const std::string& path);
// The `transformers` version whose config.json schema LlamaConfigJson writes
// (the one tools/bootstrap.sh pins and the tests compare with).
inline constexpr char kTransformersVersion[] = "5.25.0";
// A config.json for `config` in that version's schema (`rope_parameters`,
// `dtype`), with `dtype` ("float32", "bfloat16", "float16") the weights' dtype.
std::string LlamaConfigJson(const LlamaConfig& config, const std::string& dtype);

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_LLAMA_CONFIG_H_
