#include "examples/llama/chat_template.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/errors.h"
#include "examples/llama/jinja.h"

namespace shardtrain::examples::llama {
namespace {

using OrderedJson = nlohmann::ordered_json;

jinja::Value ToValue(const OrderedJson& j) {
  using jinja::Value;
  switch (j.type()) {
    case OrderedJson::value_t::null:
      return Value::None();
    case OrderedJson::value_t::boolean:
      return Value::Bool(j.get<bool>());
    case OrderedJson::value_t::number_integer:
    case OrderedJson::value_t::number_unsigned:
      return Value::Int(j.get<int64_t>());
    case OrderedJson::value_t::number_float:
      return Value::Float(j.get<double>());
    case OrderedJson::value_t::string:
      return Value::Str(j.get<std::string>());
    case OrderedJson::value_t::array: {
      jinja::List l;
      for (const OrderedJson& v : j) l.push_back(ToValue(v));
      return Value::MakeList(std::move(l));
    }
    case OrderedJson::value_t::object: {
      jinja::Dict d;
      for (const auto& [k, v] : j.items()) d.emplace_back(k, ToValue(v));
      return Value::MakeDict(std::move(d));
    }
    default:
      return Value::None();
  }
}

// transformers fills a message's "reasoning_content" (and "thinking") from
// whichever of its reasoning fields is set.
jinja::Value AliasReasoning(const jinja::Value& message) {
  if (message.kind != jinja::Value::kDict) return message;
  const jinja::Value* reasoning = nullptr;
  for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
    const jinja::Value* v = message.Find(key);
    if (reasoning == nullptr && v != nullptr && v->kind != jinja::Value::kNone) reasoning = v;
  }
  if (reasoning == nullptr) return message;
  jinja::Dict d{{"thinking", *reasoning}};
  for (const auto& [k, v] : *message.dict) {
    if (k != "thinking") d.emplace_back(k, v);
  }
  bool has = false;
  for (auto& [k, v] : d) {
    if (k == "reasoning_content") v = *reasoning, has = true;
  }
  if (!has) d.emplace_back("reasoning_content", *reasoning);
  return jinja::Value::MakeDict(std::move(d));
}

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  ST_CHECK_ARG(in, "cannot read ", path.string());
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, std::string origin,
                           std::map<std::string, std::string> special_tokens)
    : body_(std::make_shared<const jinja::Body>(jinja::Parse(source, origin))),
      origin_(std::move(origin)),
      special_tokens_(std::move(special_tokens)) {}

std::string ChatTemplate::Apply(const OrderedJson& messages, bool add_generation_prompt) const {
  ST_CHECK_ARG(messages.is_array(), origin_, ": the messages are not a JSON array");
  jinja::List list;
  for (const OrderedJson& m : messages) {
    ST_CHECK_ARG(m.is_object(), origin_, ": a message is not a JSON object: ", m.dump());
    list.push_back(AliasReasoning(ToValue(m)));
  }
  std::map<std::string, jinja::Value> globals;
  for (const auto& [k, v] : special_tokens_) globals[k] = jinja::Value::Str(v);
  globals["messages"] = jinja::Value::MakeList(std::move(list));
  globals["tools"] = jinja::Value::None();
  globals["documents"] = jinja::Value::None();
  globals["add_generation_prompt"] = jinja::Value::Bool(add_generation_prompt);
  return jinja::Render(*body_, globals, origin_);
}

std::optional<ChatTemplate> LoadChatTemplate(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(dir) / "tokenizer_config.json";
  OrderedJson config = OrderedJson::object();
  if (fs::is_regular_file(config_path)) {
    config = OrderedJson::parse(ReadText(config_path), nullptr, /*allow_exceptions=*/false);
    ST_CHECK_ARG(config.is_object(), config_path.string(), " is not a JSON object");
  }
  std::map<std::string, std::string> special;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (!config.contains(key)) continue;
    const OrderedJson& v = config[key];
    if (v.is_string()) special[key] = v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string())
      special[key] = v["content"].get<std::string>();
  }
  const fs::path jinja_path = fs::path(dir) / "chat_template.jinja";
  if (fs::is_regular_file(jinja_path)) return ChatTemplate(ReadText(jinja_path), jinja_path.string(), special);
  if (!config.contains("chat_template") || config["chat_template"].is_null()) return std::nullopt;
  const OrderedJson& t = config["chat_template"];
  const std::string origin = config_path.string() + " (chat_template)";
  if (t.is_string()) return ChatTemplate(t.get<std::string>(), origin, special);
  ST_CHECK_ARG(t.is_array(), origin, " is neither a string nor a list of {\"name\", \"template\"}");
  std::string names;
  for (const OrderedJson& named : t) {
    const std::string name = named.is_object() ? named.value("name", "") : "";
    names += (names.empty() ? "" : ", ") + name;
    if (name == "default" && named["template"].is_string())
      return ChatTemplate(named["template"].get<std::string>(), origin + "[default]", special);
  }
  ST_THROW(InvalidArgumentError, origin, " names templates (", names,
           ") but none is \"default\", the one a conversation is rendered with");
}

}  // namespace shardtrain::examples::llama
