#include "examples/llama/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "base/errors.h"
#include "base/file_util.h"

namespace shardtrain::examples::llama {
namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    ST_CHECK_ARG(status.ok(), "cannot load the SentencePiece model ", path, ": ", status.ToString());
  }
  std::vector<int64_t> Encode(const std::string& text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    ST_CHECK_ARG(status.ok(), "SentencePiece (", path_, ") could not encode a text: ", status.ToString());
    return std::vector<int64_t>(ids.begin(), ids.end());
  }
  std::string Decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> in;
    for (int64_t id : ids) {
      ST_CHECK_ARG(id >= 0 && id < vocab_size(), "token id ", id, " is outside the vocabulary [0, ", vocab_size(),
                   ") of ", path_);
      in.push_back(static_cast<int>(id));
    }
    std::string text;
    const auto status = sp_.Decode(in, &text);
    ST_CHECK_ARG(status.ok(), "SentencePiece (", path_, ") could not decode: ", status.ToString());
    return text;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int64_t bos_id() const override { return sp_.bos_id(); }
  int64_t eos_id() const override { return sp_.eos_id(); }
  std::string source() const override { return "SentencePiece " + path_; }
  std::string file() const override { return path_; }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

// The lines of a text, for the trainer.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::string& text) : in_(text) { Next(); }
  bool done() const override { return done_; }
  void Next() override { done_ = !std::getline(in_, line_); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  std::istringstream in_;
  std::string line_;
  bool done_ = false;
};

// FNV-1a: the same name for the same text on every machine.
uint64_t Fingerprint(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

std::unique_ptr<Tokenizer> LoadSentencePiece(const std::string& model_file) {
  return std::make_unique<SentencePieceTokenizer>(model_file);
}

std::unique_ptr<Tokenizer> LoadTokenizer(const std::string& path) {
  if (std::filesystem::path(path).extension() == ".json") return LoadByteLevelBpe(path);
  return LoadSentencePiece(path);
}

std::string FindTokenizerFile(const std::string& dir) {
  for (const char* name : {"tokenizer.model", "tokenizer.json"}) {
    const auto path = std::filesystem::path(dir) / name;
    if (std::filesystem::is_regular_file(path)) return path.string();
  }
  return "";
}

void CopyTokenizerFiles(const Tokenizer& tok, const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path from(tok.file());
  const bool json = from.extension() == ".json";
  std::vector<std::pair<fs::path, std::string>> files = {{from, json ? "tokenizer.json" : "tokenizer.model"}};
  if (json && fs::is_regular_file(from.parent_path() / "tokenizer_config.json")) {
    files.emplace_back(from.parent_path() / "tokenizer_config.json", "tokenizer_config.json");
  }
  for (const auto& [file, name] : files) {
    const fs::path to = fs::path(dir) / name;
    if (fs::exists(to) && fs::equivalent(file, to)) continue;
    fs::copy_file(file, to, fs::copy_options::overwrite_existing);
  }
}

std::string TrainSentencePiece(const std::string& text, int64_t vocab_size, const std::string& cache_dir) {
  ST_CHECK_ARG(vocab_size >= 260 && vocab_size <= 1 << 20, "tokenizer vocabulary size ", vocab_size,
               " is out of range (valid: 260 .. 1048576; the 256 byte pieces and 4 special tokens come first)");
  char name[64];
  std::snprintf(name, sizeof(name), "spm-bpe-%lld-%016llx.model", static_cast<long long>(vocab_size),
                static_cast<unsigned long long>(Fingerprint(text)));
  const std::string path = (std::filesystem::path(cache_dir) / name).string();
  if (std::filesystem::is_regular_file(path)) return path;
  const std::unordered_map<std::string, std::string> args = {
      {"vocab_size", std::to_string(vocab_size)},
      {"model_type", "bpe"},
      {"character_coverage", "1.0"},
      {"byte_fallback", "true"},
      {"pad_id", "3"},
      {"num_threads", "2"},
      {"minloglevel", "2"},
  };
  LineIterator lines(text);
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
  ST_CHECK_ARG(status.ok(), "training a SentencePiece tokenizer of ", vocab_size, " pieces failed: ", status.ToString(),
               " (a smaller vocabulary, or more text, may work)");
  WriteFileAtomically(path, model);
  return path;
}

}  // namespace shardtrain::examples::llama
