#include "examples/llama/sft_data.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/errors.h"

namespace shardtrain::examples::llama {
namespace {

// Whether a row of ids/labels takes any loss (a target after its first token).
bool TakesLoss(const std::vector<int64_t>& labels, size_t begin, size_t end) {
  return std::any_of(labels.begin() + begin + 1, labels.begin() + end, [](int64_t l) { return l != kIgnoreIndex; });
}

}  // namespace

std::vector<SftExample> ReadSftJsonl(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ST_CHECK_ARG(in, "cannot read --sft_data=", path);
  std::vector<SftExample> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const std::string where = path + ":" + std::to_string(n);
    ST_CHECK_ARG(j.is_object(), where, ": not a JSON object (valid: {\"prompt\": \"...\", \"completion\": \"...\"})");
    ST_CHECK_ARG(!j.contains("messages"), where,
                 ": chat \"messages\" lines need the checkpoint's chat template, which this program does not apply "
                 "(valid: {\"prompt\": \"...\", \"completion\": \"...\"}; render the chat into them first)");
    for (const char* key : {"prompt", "completion"}) {
      ST_CHECK_ARG(j.contains(key) && j[key].is_string(), where, ": \"", key, "\" is ",
                   j.contains(key) ? "not a string" : "missing",
                   " (valid: {\"prompt\": \"...\", \"completion\": ", "\"...\"})");
    }
    out.push_back({j["prompt"].get<std::string>(), j["completion"].get<std::string>()});
  }
  ST_CHECK_ARG(!out.empty(), "--sft_data=", path, " holds no examples (one JSON object per line)");
  return out;
}

SftSequence TokenizeSft(const Tokenizer& tok, const SftExample& example, int64_t bos_id, int64_t eos_id) {
  SftSequence s;
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
