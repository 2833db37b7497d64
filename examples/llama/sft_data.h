// Supervised fine-tuning data for the Llama example: prompt/completion pairs
// from JSON Lines, tokenized as [bos] prompt completion [eos] with the loss on
// the completion (and eos) only, or chats rendered by the checkpoint's chat
// template with the loss on the final assistant turn, served either padded (one example per row,
// each batch right-padded to its longest row) or packed (examples
// concatenated and cut into windows of the block size).
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_SFT_DATA_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_SFT_DATA_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "examples/llama/chat_template.h"
#include "examples/llama/tokenizer.h"
#include "trainer/data/data.h"

namespace shardtrain::examples::llama {

// The target value the loss skips (LlamaForCausalLMImpl::Loss).
inline constexpr int64_t kIgnoreIndex = -100;

struct SftExample {
  std::string prompt, completion;
  // Rendered by a chat template: the text holds the special tokens the
  // template writes (bos included), so none are added around it.
  bool chat = false;
};

// The examples of a JSON Lines file, one object per non-blank line (other
// members are ignored), each of:
//   {"prompt": "...", "completion": "..."}             plain text
//   {"messages": [{"role": ..., "content": ...}, ..., {"role": "assistant", ...}]}
//   {"prompt": [messages...], "completion": [messages...]}   (TRL's conversational form)
// A chat's prompt is the template's rendering of the turns before the
// completion (all but the last message) with the generation prompt; its
// completion is the rest of the rendering of the whole conversation, so the
// loss falls on the final assistant turn and what the template writes after
// it. `chat` gives the template (nullptr: none) and is called only when a
// chat line is met. Throws InvalidArgumentError naming the file, the line and
// what is wrong.
std::vector<SftExample> ReadSftJsonl(const std::string& path,
                                     const std::function<const ChatTemplate*()>& chat = nullptr);

// One tokenized example: ids and, position by position, the target id or
// kIgnoreIndex (prompt and bos).
struct SftSequence {
  std::vector<int64_t> ids, labels;
};

// [bos] prompt completion [eos] (bos/eos when >= 0 and the example is not a
// chat); labels are the ids of the completion and eos, kIgnoreIndex
// elsewhere. Prompt and completion are encoded separately, so their boundary
// is a token boundary.
SftSequence TokenizeSft(const Tokenizer& tok, const SftExample& example, int64_t bos_id, int64_t eos_id);

// Batches for the Trainer: inputs [B, T] and targets [B, T] (targets are the
// labels shifted by one; kIgnoreIndex where no loss is taken).
class SftDataset : public trainer::Dataset {
 public:
  // Rows without a completion token (after their first) are left out: a
  // batch of them would have no loss.
  // Padded: one row per sequence, cut to block + 1 tokens; a batch is padded
  // on the right to its longest row with `pad_id` and kIgnoreIndex targets.
  // Causal attention never lets a real token see the padding after it, so no
  // attention mask is needed: the logits of real tokens equal an unpadded run.
  static SftDataset Padded(const std::vector<SftSequence>& sequences, int64_t block, int64_t pad_id);
  // Packed: all sequences concatenated and cut into windows of block + 1
  // tokens (the last partial window dropped); attention crosses examples.
  static SftDataset Packed(const std::vector<SftSequence>& sequences, int64_t block);

  int64_t size() const override { return static_cast<int64_t>(rows_.size()); }
  trainer::Batch get_batch(const std::vector<int64_t>& indices) const override;
  // Targets that take a loss, over all rows.
  int64_t loss_tokens() const;

 private:
  std::vector<SftSequence> rows_;  // each of length <= block + 1
  int64_t pad_id_ = 0;
};

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_SFT_DATA_H_
