#include "examples/llama/llama_config.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/errors.h"

namespace shardtrain::examples::llama {
namespace {

using Json = nlohmann::json;

// Reads optional fields of one JSON object, naming `where` and the key in errors.
class Fields {
 public:
  Fields(const Json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  bool Has(const char* key) const { return obj_.contains(key) && !obj_.at(key).is_null(); }
  void Int(const char* key, int64_t& out) const {
    if (!Has(key)) return;
    const Json& v = obj_.at(key);
    ST_CHECK_ARG(v.is_number_integer(), where_, ": \"", key, "\" must be an integer, got ", v.dump());
    out = v.get<int64_t>();
  }
  void Real(const char* key, double& out) const {
    if (!Has(key)) return;
    const Json& v = obj_.at(key);
    ST_CHECK_ARG(v.is_number(), where_, ": \"", key, "\" must be a number, got ", v.dump());
    out = v.get<double>();
  }
  void Bool(const char* key, bool& out) const {
    if (!Has(key)) return;
    const Json& v = obj_.at(key);
    ST_CHECK_ARG(v.is_boolean(), where_, ": \"", key, "\" must be true or false, got ", v.dump());
    out = v.get<bool>();
  }
  void String(const char* key, std::string& out) const {
    if (!Has(key)) return;
    const Json& v = obj_.at(key);
    ST_CHECK_ARG(v.is_string(), where_, ": \"", key, "\" must be a string, got ", v.dump());
    out = v.get<std::string>();
  }
  // An integer or a list of integers (eos_token_id).
  void Ints(const char* key, std::vector<int64_t>& out) const {
    if (!Has(key)) return;
    const Json& v = obj_.at(key);
    const bool ok =
        v.is_number_integer() ||
        (v.is_array() && std::all_of(v.begin(), v.end(), [](const Json& e) { return e.is_number_integer(); }));
    ST_CHECK_ARG(ok, where_, ": \"", key, "\" must be an integer or a list of integers, got ", v.dump());
    out.clear();
    if (v.is_array()) {
      for (const Json& e : v) out.push_back(e.get<int64_t>());
    } else {
      out.push_back(v.get<int64_t>());
    }
  }

 private:
  const Json& obj_;
  std::string where_;
};

// `rope_scaling` (4.x) or `rope_parameters` (5.x): the type under "rope_type"
// or, in older files, "type"; 5.x also keeps "rope_theta" here.
void ParseRope(const Json& obj, const std::string& where, RopeConfig& rope) {
  ST_CHECK_ARG(obj.is_object(), where, " must be an object, got ", obj.dump());
  Fields f(obj, where);
  if (f.Has("rope_type")) {
    f.String("rope_type", rope.type);
  } else {
    f.String("type", rope.type);
  }
  f.Real("rope_theta", rope.theta);
  f.Real("factor", rope.factor);
  f.Real("low_freq_factor", rope.low_freq_factor);
  f.Real("high_freq_factor", rope.high_freq_factor);
  f.Int("original_max_position_embeddings", rope.original_max_position_embeddings);
  double partial = 1.0;
  f.Real("partial_rotary_factor", partial);
  ST_CHECK_ARG(partial == 1.0, where, ": \"partial_rotary_factor\" ", partial, " is not supported (only 1.0)");
}

void ParseFields(const Json& j, const std::string& where, LlamaConfig& c) {
  Fields f(j, where);
  f.Int("vocab_size", c.vocab_size);
  f.Int("hidden_size", c.hidden_size);
  f.Int("intermediate_size", c.intermediate_size);
  f.Int("num_hidden_layers", c.num_hidden_layers);
  f.Int("num_attention_heads", c.num_attention_heads);
  c.num_key_value_heads = c.num_attention_heads;
  f.Int("num_key_value_heads", c.num_key_value_heads);
  c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  f.Int("head_dim", c.head_dim);
  f.Int("max_position_embeddings", c.max_position_embeddings);
  f.Real("rms_norm_eps", c.rms_norm_eps);
  f.Bool("attention_bias", c.attention_bias);
  f.Bool("mlp_bias", c.mlp_bias);
  f.Bool("tie_word_embeddings", c.tie_word_embeddings);
  f.String("hidden_act", c.hidden_act);
  f.Real("initializer_range", c.initializer_range);
  f.Int("bos_token_id", c.bos_token_id);
  f.Int("pad_token_id", c.pad_token_id);
  f.Ints("eos_token_id", c.eos_token_ids);
  f.Real("rope_theta", c.rope.theta);
  if (f.Has("rope_parameters")) {
    ParseRope(j.at("rope_parameters"), where + ": \"rope_parameters\"", c.rope);
  } else if (f.Has("rope_scaling")) {
    ParseRope(j.at("rope_scaling"), where + ": \"rope_scaling\"", c.rope);
  }
  if (c.rope.type == "llama3" && c.rope.original_max_position_embeddings == 0) {
    c.rope.original_max_position_embeddings = c.max_position_embeddings;  // transformers' fallback
  }
  if (f.Has("pretraining_tp")) {
    int64_t tp = 1;
    f.Int("pretraining_tp", tp);
    ST_CHECK_ARG(tp == 1, where, ": \"pretraining_tp\" ", tp, " is not supported (only 1, the default)");
  }
}

}  // namespace

void LlamaConfig::Validate() const {
  auto positive = [](const char* name, int64_t v) {
    ST_CHECK_ARG(v > 0, "Llama config: \"", name, "\" must be positive, got ", v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  positive("max_position_embeddings", max_position_embeddings);
  ST_CHECK_ARG(num_attention_heads % num_key_value_heads == 0, "Llama config: num_attention_heads (",
               num_attention_heads, ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
  ST_CHECK_ARG(head_dim % 2 == 0, "Llama config: head_dim must be even for rotary embeddings, got ", head_dim);
  ST_CHECK_ARG(rms_norm_eps > 0, "Llama config: rms_norm_eps must be positive, got ", rms_norm_eps);
  ST_CHECK_ARG(hidden_act == "silu", "Llama config: hidden_act \"", hidden_act, "\" is not supported (valid: silu)");
  ST_CHECK_ARG(rope.theta > 0, "Llama config: rope_theta must be positive, got ", rope.theta);
  ST_CHECK_ARG(rope.type == "default" || rope.type == "linear" || rope.type == "llama3", "Llama config: rope type \"",
               rope.type, "\" is not supported (valid: default, linear, llama3)");
  if (rope.type != "default") {
    ST_CHECK_ARG(rope.factor > 0, "Llama config: rope factor must be positive, got ", rope.factor);
  }
  if (rope.type == "llama3") {
    ST_CHECK_ARG(rope.original_max_position_embeddings > 0 && rope.high_freq_factor > rope.low_freq_factor &&
                     rope.low_freq_factor > 0,
                 "Llama config: llama3 rope needs original_max_position_embeddings > 0 and high_freq_factor > "
                 "low_freq_factor > 0, got ",
                 rope.original_max_position_embeddings, ", ", rope.high_freq_factor, ", ", rope.low_freq_factor);
  }
}

int64_t LlamaConfig::NumParameters() const {
  const int64_t q = num_attention_heads * head_dim, kv = num_key_value_heads * head_dim;
  const int64_t attn = hidden_size * (q + 2 * kv) + q * hidden_size + (attention_bias ? q + 2 * kv + hidden_size : 0);
  const int64_t mlp = 3 * hidden_size * intermediate_size + (mlp_bias ? 2 * intermediate_size + hidden_size : 0);
  const int64_t layer = attn + mlp + 2 * hidden_size;
  const int64_t embed = vocab_size * hidden_size;
  return embed * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * layer + hidden_size;
}

std::string LlamaConfig::ToString() const {
  std::ostringstream os;
  os << "Llama(vocab=" << vocab_size << ", hidden=" << hidden_size << ", intermediate=" << intermediate_size
     << ", layers=" << num_hidden_layers << ", heads=" << num_attention_heads << ", kv_heads=" << num_key_value_heads
     << ", head_dim=" << head_dim << ", rope=" << rope.type << "/" << rope.theta
     << (tie_word_embeddings ? ", tied" : "") << ", params=" << NumParameters() << ")";
  return os.str();
}

LlamaConfig ParseLlamaConfig(const std::string& json_text, const std::string& where) {
  Json j = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  ST_CHECK_ARG(!j.is_discarded() && j.is_object(), where, ": not a JSON object");
  std::string model_type = "llama";
  Fields(j, where).String("model_type", model_type);
  ST_CHECK_ARG(model_type == "llama", where, ": model_type \"", model_type, "\" is not supported (valid: llama)");
  LlamaConfig c;
  ParseFields(j, where, c);
  try {
    c.Validate();
  } catch (const InvalidArgumentError& e) {
    ST_THROW(InvalidArgumentError, where, ": ", e.what());
  }
  return c;
}

LlamaConfig ReadLlamaConfig(const std::string& path) {
  std::ifstream in(path);
  ST_CHECK_ARG(in.good(), "cannot open Llama config ", path);
  std::stringstream text;
  text << in.rdbuf();
  return ParseLlamaConfig(text.str(), path);
}

std::string LlamaConfigJson(const LlamaConfig& c, const std::string& dtype) {
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["hidden_act"] = c.hidden_act;
  j["attention_bias"] = c.attention_bias;
  j["mlp_bias"] = c.mlp_bias;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["initializer_range"] = c.initializer_range;
  nlohmann::ordered_json rope{{"rope_type", c.rope.type}, {"rope_theta", c.rope.theta}};
  if (c.rope.type != "default") rope["factor"] = c.rope.factor;
  if (c.rope.type == "llama3") {
    rope["low_freq_factor"] = c.rope.low_freq_factor;
    rope["high_freq_factor"] = c.rope.high_freq_factor;
    rope["original_max_position_embeddings"] = c.rope.original_max_position_embeddings;
  }
  j["rope_parameters"] = rope;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.pad_token_id >= 0) j["pad_token_id"] = c.pad_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  if (c.eos_token_ids.size() > 1) j["eos_token_id"] = c.eos_token_ids;
  j["dtype"] = dtype;
  j["transformers_version"] = kTransformersVersion;
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

}  // namespace shardtrain::examples::llama
