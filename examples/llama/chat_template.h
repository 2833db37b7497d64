// Chat templates of Hugging Face checkpoints: the Jinja template that turns a
// conversation ([{"role": ..., "content": ...}, ...]) into the text a chat
// model was trained on, rendered as transformers' apply_chat_template(...,
// tokenize=False) renders it. The Jinja subset covers what chat templates
// use (if/for/set, loop, namespace, filters, tests, str and dict methods,
// raise_exception); anything else is refused by name when the template loads.
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_CHAT_TEMPLATE_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_CHAT_TEMPLATE_H_

#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

namespace shardtrain::examples::llama {

namespace jinja {
struct Node;
}

class ChatTemplate {
 public:
  // Parses `source`; `origin` names it in errors. `special_tokens` (bos_token,
  // eos_token, ...) are variables of the template, as transformers passes its
  // tokenizer's special_tokens_map. Throws InvalidArgumentError naming the
  // origin, the line and what is wrong.
  ChatTemplate(const std::string& source, std::string origin, std::map<std::string, std::string> special_tokens);

  // The text of `messages` (a JSON array of message objects), with the
  // assistant's header after it when `add_generation_prompt`. A template's
  // raise_exception, and every error while rendering, throws
  // InvalidArgumentError naming the origin and the line.
  std::string Apply(const nlohmann::ordered_json& messages, bool add_generation_prompt) const;

  const std::string& origin() const { return origin_; }

 private:
  std::shared_ptr<const std::vector<jinja::Node>> body_;
  std::string origin_;
  std::map<std::string, std::string> special_tokens_;
};

// The chat template of a Hugging Face directory: chat_template.jinja, else
// tokenizer_config.json's "chat_template" (a string, or a list of {"name",
// "template"} of which "default" is used), with the special tokens of
// tokenizer_config.json. nullopt when the directory has none.
std::optional<ChatTemplate> LoadChatTemplate(const std::string& dir);

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_CHAT_TEMPLATE_H_
