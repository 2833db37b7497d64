// Tokenizers for the Llama example: SentencePiece models (`tokenizer.model`,
// as Llama 2 and Mistral checkpoints ship them) through Debian's
// libsentencepiece; byte-level BPE from a Hugging Face `tokenizer.json`
// (Llama 3, Qwen, GPT-2) through Debian's PCRE2 and ICU; and, for runs from
// scratch, a SentencePiece BPE model trained on the training text and cached
// so later runs reuse it.
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

// Loads a byte-level BPE tokenizer.json: model BPE (merges as "a b" strings
// or pairs, ignore_merges), normalizer null/NFC/NFD/NFKC/NFKD or a Sequence,
// pre-tokenizer ByteLevel and Split (Isolated) steps, decoder ByteLevel,
// added tokens (split out of the text first; lstrip/rstrip). bos/eos come from
// tokenizer_config.json beside it when present. Encodes as Python
// `tokenizers`' encode(text, add_special_tokens=False). Anything else in the
// file is refused with an InvalidArgumentError naming it and what is valid.
std::unique_ptr<Tokenizer> LoadByteLevelBpe(const std::string& tokenizer_json);

// LoadByteLevelBpe for a .json file, LoadSentencePiece otherwise.
std::unique_ptr<Tokenizer> LoadTokenizer(const std::string& path);

// The tokenizer file of a Hugging Face model directory: tokenizer.model
// (SentencePiece) when present, else tokenizer.json; "" when it has neither.
std::string FindTokenizerFile(const std::string& dir);

// Copies the file `tok` was loaded from into `dir` as tokenizer.json (a .json)
// or tokenizer.model (with tokenizer_config.json when one lies beside a
// tokenizer.json), the names transformers' AutoTokenizer looks for.
void CopyTokenizerFiles(const Tokenizer& tok, const std::string& dir);

// A SentencePiece BPE model of `vocab_size` pieces (byte fallback, so every
// text encodes) trained on `text`: returns the path of the model file, named
// by a hash of the text and the size, in `cache_dir` (created). An existing
// model of that name is reused; a new one is written atomically.
std::string TrainSentencePiece(const std::string& text, int64_t vocab_size, const std::string& cache_dir);

}  // namespace shardtrain::examples::llama

#endif  // SHARDTRAIN_EXAMPLES_LLAMA_TOKENIZER_H_
