#include "examples/llama/sft_data.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/errors.h"

namespace shardtrain::examples::llama {
namespace {

using Json = nlohmann::ordered_json;

// Whether a row of ids/labels takes any loss (a target after its first token).
bool TakesLoss(const std::vector<int64_t>& labels, size_t begin, size_t end) {
  return std::any_of(labels.begin() + begin + 1, labels.begin() + end, [](int64_t l) { return l != kIgnoreIndex; });
}

const char* const kValidLines =
    "{\"prompt\": \"...\", \"completion\": \"...\"}, {\"messages\": [{\"role\": ..., \"content\": ...}, ..., "
    "{\"role\": \"assistant\", ...}]} or {\"prompt\": [messages], \"completion\": [messages]}";

// Each message an object with a string "role"; `what` names the list.
void CheckMessages(const Json& messages, const std::string& where, const std::string& what) {
  ST_CHECK_ARG(messages.is_array(), where, ": \"", what, "\" is not a list of messages (valid: ", kValidLines, ")");
  for (const Json& m : messages) {
    ST_CHECK_ARG(m.is_object() && m.contains("role") && m["role"].is_string(), where, ": a message in \"", what,
                 "\" is not an object with a string \"role\": ", m.dump());
  }
}

// A chat line rendered: the prompt turns with the generation prompt, and the
// rest of the whole conversation's rendering as the completion.
SftExample RenderChat(const Json& j, const ChatTemplate& chat, const std::string& where) {
  Json prompt, whole;
  if (j.contains("messages")) {
    whole = j["messages"];
    CheckMessages(whole, where, "messages");
    ST_CHECK_ARG(!whole.empty() && whole.back()["role"] == "assistant", where,
                 ": the last message must be the assistant's (the loss is taken on it), not ",
                 whole.empty() ? std::string("an empty list") : whole.back()["role"].dump());
    prompt = whole;
    prompt.erase(prompt.size() - 1);
  } else {
    prompt = j["prompt"];
    CheckMessages(prompt, where, "prompt");
    ST_CHECK_ARG(j.contains("completion"), where, ": \"completion\" is missing (valid: ", kValidLines, ")");
    CheckMessages(j["completion"], where, "completion");
    ST_CHECK_ARG(!j["completion"].empty(), where, ": \"completion\" holds no message");
    whole = prompt;
    for (const Json& m : j["completion"]) whole.push_back(m);
  }
  std::string head, all;
  try {
    head = chat.Apply(prompt, /*add_generation_prompt=*/true);
    all = chat.Apply(whole, /*add_generation_prompt=*/false);
  } catch (const InvalidArgumentError& e) {
    ST_THROW(InvalidArgumentError, where, ": ", e.what());
  }
  ST_CHECK_ARG(all.compare(0, head.size(), head) == 0, where, ": ", chat.origin(),
               " renders the whole conversation as a text that does not begin with its rendering of the prompt "
               "turns and the generation prompt, so the completion cannot be cut out of it (prompt: ",
               Json(head).dump(), ", whole: ", Json(all).dump(), ")");
  return {head, all.substr(head.size()), /*chat=*/true};
}

}  // namespace

std::vector<SftExample> ReadSftJsonl(const std::string& path, const std::function<const ChatTemplate*()>& chat) {
  std::ifstream in(path, std::ios::binary);
  ST_CHECK_ARG(in, "cannot read --sft_data=", path);
  std::vector<SftExample> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    const std::string where = path + ":" + std::to_string(n);
    ST_CHECK_ARG(j.is_object(), where, ": not a JSON object (valid: ", kValidLines, ")");
    if (j.contains("messages") || (j.contains("prompt") && j["prompt"].is_array())) {
      const ChatTemplate* tmpl = chat ? chat() : nullptr;
      ST_CHECK_ARG(tmpl != nullptr, where,
                   ": a chat line needs the checkpoint's chat template, and none was found (a Hugging Face "
                   "directory keeps it in chat_template.jinja or tokenizer_config.json's \"chat_template\"; "
                   "give one with --hf_checkpoint, or write the line as {\"prompt\": \"...\", \"completion\": "
                   "\"...\"})");
      out.push_back(RenderChat(j, *tmpl, where));
      continue;
    }
    for (const char* key : {"prompt", "completion"}) {
      ST_CHECK_ARG(j.contains(key) && j[key].is_string(), where, ": \"", key, "\" is ",
                   j.contains(key) ? "not a string" : "missing", " (valid: ", kValidLines, ")");
    }
    out.push_back({j["prompt"].get<std::string>(), j["completion"].get<std::string>()});
  }
  ST_CHECK_ARG(!out.empty(), "--sft_data=", path, " holds no examples (one JSON object per line)");
  return out;
}

SftSequence TokenizeSft(const Tokenizer& tok, const SftExample& example, int64_t bos_id, int64_t eos_id) {
  SftSequence s;
  if (example.chat) bos_id = eos_id = -1;  // the template wrote them
  if (bos_id >= 0) s.ids.push_back(bos_id);
  const std::vector<int64_t> prompt = tok.Encode(example.prompt), completion = tok.Encode(example.completion);
  s.ids.insert(s.ids.end(), prompt.begin(), prompt.end());
  s.labels.assign(s.ids.size(), kIgnoreIndex);
  s.ids.insert(s.ids.end(), completion.begin(), completion.end());
  if (eos_id >= 0) s.ids.push_back(eos_id);
  s.labels.insert(s.labels.end(), s.ids.begin() + static_cast<int64_t>(s.labels.size()), s.ids.end());
  return s;
}

SftDataset SftDataset::Padded(const std::vector<SftSequence>& sequences, int64_t block, int64_t pad_id) {
  SftDataset d;
  d.pad_id_ = pad_id;
  for (const SftSequence& s : sequences) {
    const size_t n = std::min<size_t>(s.ids.size(), block + 1);
    if (n < 2 || !TakesLoss(s.labels, 0, n)) continue;  // the completion lies beyond the block
    d.rows_.push_back({{s.ids.begin(), s.ids.begin() + n}, {s.labels.begin(), s.labels.begin() + n}});
  }
  ST_CHECK_ARG(!d.rows_.empty(), "no fine-tuning example has a completion token within --block_size + 1 = ", block + 1,
               " tokens (a longer block, or shorter prompts)");
  return d;
}

SftDataset SftDataset::Packed(const std::vector<SftSequence>& sequences, int64_t block) {
  SftSequence all;
  for (const SftSequence& s : sequences) {
    all.ids.insert(all.ids.end(), s.ids.begin(), s.ids.end());
    all.labels.insert(all.labels.end(), s.labels.begin(), s.labels.end());
  }
  SftDataset d;
  const size_t w = block + 1;
  for (size_t at = 0; at + w <= all.ids.size(); at += w) {
    if (!TakesLoss(all.labels, at, at + w)) continue;  // a window of prompt only
    d.rows_.push_back(
        {{all.ids.begin() + at, all.ids.begin() + at + w}, {all.labels.begin() + at, all.labels.begin() + at + w}});
  }
  ST_CHECK_ARG(!d.rows_.empty(), "the fine-tuning examples hold ", all.ids.size(),
               " tokens, no packed window of --block_size + 1 = ", w, " of them with a completion token");
  return d;
}

trainer::Batch SftDataset::get_batch(const std::vector<int64_t>& indices) const {
  size_t t = 0;
  for (int64_t i : indices) t = std::max(t, rows_.at(i).ids.size() - 1);
  at::Tensor inputs = at::full({static_cast<int64_t>(indices.size()), static_cast<int64_t>(t)}, pad_id_, at::kLong);
  at::Tensor targets = at::full_like(inputs, kIgnoreIndex);
  auto x = inputs.accessor<int64_t, 2>();
  auto y = targets.accessor<int64_t, 2>();
  for (size_t r = 0; r < indices.size(); ++r) {
    const SftSequence& s = rows_[indices[r]];
    for (size_t k = 0; k + 1 < s.ids.size(); ++k) {
      x[r][k] = s.ids[k];
      y[r][k] = s.labels[k + 1];
    }
  }
  return {inputs, targets};
}

int64_t SftDataset::loss_tokens() const {
  int64_t n = 0;
  for (const SftSequence& s : rows_)
    n += std::count_if(s.labels.begin() + 1, s.labels.end(), [](int64_t l) { return l != kIgnoreIndex; });
  return n;
}

}  // namespace shardtrain::examples::llama
