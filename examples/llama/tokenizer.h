// Tokenizers for the Llama example: SentencePiece models (`tokenizer.model`,
// as Llama 2 and Mistral checkpoints ship them) through Debian's
// libsentencepiece, and, for runs from scratch, a SentencePiece BPE model
// trained on the training text and cached so later runs reuse it.
#ifndef SHARDTRAIN_EXAMPLES_LLAMA_TOKENIZER_H_
#define SHARDTRAIN_EXAMPLES_LLAMA_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain::examples::llama {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text`, without special tokens.
  virtual std::vector<int64_t> Encode(const std::string& text) const = 0;
  virtual std::string Decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t bos_id() const = 0;  // -1: none
  virtual int64_t eos_id() const = 0;  // -1: none
  // What it is and where it was loaded from (for logs).
  virtual std::string source() const = 0;
  // The model file it was loaded from (copied beside a Hugging Face export).
  virtual std::string file() const = 0;
};

// Loads a SentencePiece model file; throws InvalidArgumentError naming it.
std::unique_ptr<Tokenizer> LoadSentencePiece(const std::string& model_file);

// A SentencePiece BPE model of `vocab_size` pieces (byte fallback, so every
// text encodes) trained on `text`: returns the path of the model file, named
// by a hash of the text and the size, in `cache_dir` (created). An existing
// model of that name is reused; a new one is written atomically.
std::string TrainSentencePiece(const std::string& text, int64_t vocab_size, const std::string& cache_dir);

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_TOKENIZER_H_
