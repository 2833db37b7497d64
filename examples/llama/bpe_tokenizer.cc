// Byte-level BPE from a Hugging Face tokenizer.json (Llama 3, Qwen, GPT-2 and
// most recent models), encoding as Python `tokenizers` does: added tokens
// split out first, then the normalizer (ICU), the pre-tokenizer's regular
// expressions (PCRE2, Unicode properties), the byte-to-character map, and the
// merges applied lowest rank first within each piece.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <array>
#include <climits>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "base/errors.h"
#include "examples/llama/tokenizer.h"

namespace shardtrain::examples::llama {
namespace {

using Json = nlohmann::json;

constexpr int64_t kMaxTokens = 1 << 21;  // ids 0 .. 2097151: the largest vocabularies have ~256K

// GPT-2's pre-tokenizer expression, which ByteLevel uses when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's byte-to-character map: printable bytes stand for themselves, the
// others for the characters from U+0100 on, so every byte is a visible symbol.
struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<std::string, unsigned char> to_byte;
  ByteMap() {
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const int cp = printable ? b : next++;
      std::string s = cp < 0x80
                          ? std::string(1, static_cast<char>(cp))
                          : std::string{static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
      to_byte[s] = static_cast<unsigned char>(b);
      to_char[b] = std::move(s);
    }
  }
};

const ByteMap& Bytes() {
  static const ByteMap map;
  return map;
}

// Length of the UTF-8 character that starts with byte `c` (1 for a stray byte).
size_t Utf8Length(unsigned char c) { return c < 0xC0 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

// A compiled PCRE2 expression (UTF, Unicode properties for \s \w \d).
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &error,
                          &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      ST_THROW(InvalidArgumentError, where, ": the pre-tokenizer's regular expression does not compile at offset ",
               offset, ": ", reinterpret_cast<char*>(message));
    }
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // `text` cut into the matches and the text between them, in order.
  // Thread-safe: the match data is the call's own.
  std::vector<std::string> Split(const std::string& text) const {
    std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> match(
        pcre2_match_data_create_from_pattern(code_, nullptr), pcre2_match_data_free);
    pcre2_match_data* data = match.get();
    std::vector<std::string> out;
    size_t at = 0, gap = 0;
    while (at <= text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at,
                                 at == 0 ? 0 : PCRE2_NO_UTF_CHECK, data, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(rc, message, sizeof(message));
        ST_THROW(InvalidArgumentError, "the pre-tokenizer's expression failed on the text at byte ", at, ": ",
                 reinterpret_cast<char*>(message),
                 rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21 ? " (the text is not valid UTF-8)" : "");
      }
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(data);
      if (v[1] == v[0]) {  // an empty match: step over one character
        at = v[0] + (v[0] < text.size() ? Utf8Length(text[v[0]]) : 1);
        continue;
      }
      if (v[0] > gap) out.push_back(text.substr(gap, v[0] - gap));
      out.push_back(text.substr(v[0], v[1] - v[0]));
      at = gap = v[1];
    }
    if (gap < text.size()) out.push_back(text.substr(gap));
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

// One step of the pre-tokenizer: a regular-expression split ("Split",
// behavior Isolated) or ByteLevel (optional prefix space and GPT-2 split, then
// bytes to characters).
struct PreTokenizerStep {
  std::unique_ptr<Regex> split;
  bool byte_level = false;
  bool add_prefix_space = false;
};

// Unicode normalization forms a tokenizer.json may ask for, through ICU.
const icu::Normalizer2* NormalizerFor(const std::string& type, const std::string& where) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = type == "NFC"    ? icu::Normalizer2::getNFCInstance(status)
                              : type == "NFD"  ? icu::Normalizer2::getNFDInstance(status)
                              : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(status)
                              : type == "NFKD" ? icu::Normalizer2::getNFKDInstance(status)
                                               : nullptr;
  ST_CHECK_ARG(n != nullptr, where, ": normalizer \"", type, "\" is not supported (valid: null, NFC, NFD, NFKC, NFKD ",
               "or a Sequence of them)");
  ST_CHECK_ARG(U_SUCCESS(status), where, ": ICU has no ", type, " data: ", u_errorName(status));
  return n;
}

std::string JsonType(const Json& j) { return j.is_object() && j.contains("type") ? j["type"].dump() : j.dump(); }

// The steps of a Sequence, or the one step itself.
std::vector<Json> Steps(const Json& j, const char* list_key) {
  if (j.is_object() && j.value("type", "") == "Sequence") return j.at(list_key).get<std::vector<Json>>();
  return {j};
}

struct AddedToken {
  std::string content;
  int64_t id = 0;
  bool lstrip = false, rstrip = false;
};

class ByteLevelBpe : public Tokenizer {
 public:
  explicit ByteLevelBpe(const std::string& path) : path_(path) {
    std::ifstream in(path, std::ios::binary);
    ST_CHECK_ARG(in, "cannot read the tokenizer ", path);
    Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    ST_CHECK_ARG(j.is_object(), path, ": not a JSON object (a Hugging Face tokenizer.json)");
    try {
      ReadModel(j.at("model"));
      ReadNormalizer(j.value("normalizer", Json()));
      ReadPreTokenizer(j.value("pre_tokenizer", Json()));
      ReadDecoder(j.value("decoder", Json()));
      ReadAddedTokens(j.value("added_tokens", Json::array()));
    } catch (const Json::exception& e) {
      ST_THROW(InvalidArgumentError, path, ": not a tokenizer.json this reader understands: ", e.what());
    }
    ReadSpecialIds();
  }

  std::vector<int64_t> Encode(const std::string& text) const override {
    std::vector<int64_t> ids;
    size_t at = 0;
    while (at < text.size()) {
      size_t begin = text.size(), end = text.size();
      const AddedToken* token = FindAdded(text, at, &begin, &end);
      EncodeOrdinary(text.substr(at, begin - at), ids);
      if (token == nullptr) break;
      ids.push_back(token->id);
      at = end;
    }
    return ids;
  }

  std::string Decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) {
      ST_CHECK_ARG(id >= 0 && id < vocab_size(), "token id ", id, " is outside the vocabulary [0, ", vocab_size(),
                   ") of ", path_);
      const std::string& token = id_to_token_[id];
      if (added_ids_.count(id) > 0) {
        out += token;
        continue;
      }
      for (size_t i = 0; i < token.size();) {
        const size_t n = Utf8Length(token[i]);
        const auto b = Bytes().to_byte.find(token.substr(i, n));
        out += b != Bytes().to_byte.end() ? std::string(1, static_cast<char>(b->second)) : token.substr(i, n);
        i += n;
      }
    }
    return out;
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  int64_t bos_id() const override { return bos_id_; }
  int64_t eos_id() const override { return eos_id_; }
  std::string source() const override { return "byte-level BPE " + path_; }
  std::string file() const override { return path_; }

 private:
  void ReadModel(const Json& m) {
    ST_CHECK_ARG(m.value("type", "BPE") == "BPE", path_, ": model type ", JsonType(m),
                 " is not supported (valid: BPE, byte-level)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      ST_CHECK_ARG(!m.contains(key) || m[key].is_null() || m[key] == "", path_, ": model.", key, " ", m[key].dump(),
                   " is not supported (valid: null)");
    }
    ST_CHECK_ARG(!m.contains("dropout") || m["dropout"].is_null() || m["dropout"] == 0.0, path_,
                 ": BPE dropout is not supported (it makes encoding random; valid: null)");
    ignore_merges_ = m.value("ignore_merges", false);
    for (const auto& [token, id] : m.at("vocab").items()) SetToken(id.get<int64_t>(), token);
    int rank = 0;
    for (const Json& merge : m.at("merges")) {
      std::string a, b;
      if (merge.is_string()) {
        const std::string s = merge.get<std::string>();
        const size_t space = s.find(' ');
        ST_CHECK_ARG(space != std::string::npos, path_, ": merge ", merge.dump(), " is not \"a b\"");
        a = s.substr(0, space), b = s.substr(space + 1);
      } else {
        a = merge.at(0).get<std::string>(), b = merge.at(1).get<std::string>();
      }
      merges_.emplace(a + '\x01' + b, rank++);
    }
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      const auto it = vocab_.find(m["unk_token"].get<std::string>());
      if (it != vocab_.end()) unk_id_ = it->second;
    }
  }

  void SetToken(int64_t id, const std::string& token) {
    ST_CHECK_ARG(id >= 0 && id < kMaxTokens, path_, ": token ", Json(token).dump(), " has id ", id, " (valid: 0 .. ",
                 kMaxTokens - 1, ")");
    if (id >= static_cast<int64_t>(id_to_token_.size())) id_to_token_.resize(id + 1);
    id_to_token_[id] = token;
    vocab_[token] = id;
  }

  void ReadNormalizer(const Json& j) {
    if (j.is_null()) return;
    for (const Json& step : Steps(j, "normalizers")) {
      normalizers_.push_back(NormalizerFor(step.at("type").get<std::string>(), path_));
    }
  }

  void ReadPreTokenizer(const Json& j) {
    if (j.is_null()) return;
    for (const Json& step : Steps(j, "pretokenizers")) {
      PreTokenizerStep s;
      const std::string type = step.at("type").get<std::string>();
      if (type == "ByteLevel") {
        s.byte_level = true;
        s.add_prefix_space = step.value("add_prefix_space", false);
        if (step.value("use_regex", true)) s.split = std::make_unique<Regex>(kGpt2Pattern, path_);
      } else if (type == "Split") {
        const Json& pattern = step.at("pattern");
        ST_CHECK_ARG(step.value("behavior", "") == "Isolated" && !step.value("invert", false), path_,
                     ": Split behavior ", step.value("behavior", Json()).dump(), " invert ",
                     step.value("invert", false), " is not supported (valid: Isolated, not inverted)");
        std::string regex = pattern.contains("Regex") ? pattern["Regex"].get<std::string>() : "";
        if (pattern.contains("String")) {  // a literal: quoted for PCRE2
          regex = "\\Q" + pattern["String"].get<std::string>() + "\\E";
        }
        ST_CHECK_ARG(!regex.empty(), path_, ": Split pattern ", pattern.dump(), " has no Regex or String");
        s.split = std::make_unique<Regex>(regex, path_);
      } else {
        ST_THROW(InvalidArgumentError, path_, ": pre-tokenizer \"", type,
                 "\" is not supported (valid: ByteLevel, Split, or a ",
                 "Sequence of them; SentencePiece-style tokenizers load from tokenizer.model)");
      }
      pre_tokenizer_.push_back(std::move(s));
    }
    const bool byte_level = std::any_of(pre_tokenizer_.begin(), pre_tokenizer_.end(),
                                        [](const PreTokenizerStep& s) { return s.byte_level; });
    ST_CHECK_ARG(byte_level, path_, ": the pre-tokenizer has no ByteLevel step (valid: byte-level BPE; ",
                 "SentencePiece-style tokenizers load from tokenizer.model)");
  }

  void ReadDecoder(const Json& j) {
    for (const Json& step : j.is_null() ? std::vector<Json>() : Steps(j, "decoders")) {
      ST_CHECK_ARG(step.value("type", "") == "ByteLevel", path_, ": decoder ", JsonType(step),
                   " is not supported (valid: ByteLevel)");
    }
  }

  void ReadAddedTokens(const Json& list) {
    for (const Json& t : list) {
      AddedToken a;
      a.content = t.at("content").get<std::string>();
      a.id = t.at("id").get<int64_t>();
      a.lstrip = t.value("lstrip", false);
      a.rstrip = t.value("rstrip", false);
      ST_CHECK_ARG(!t.value("single_word", false), path_, ": added token ", Json(a.content).dump(),
                   " has single_word: true, which is not supported (valid: false)");
      ST_CHECK_ARG(!a.content.empty(), path_, ": an added token with id ", a.id, " is empty");
      SetToken(a.id, a.content);
      added_ids_.insert(a.id);
      added_.push_back(a);
    }
  }

  // bos/eos from tokenizer_config.json beside the file, when it names them.
  void ReadSpecialIds() {
    const auto config = std::filesystem::path(path_).parent_path() / "tokenizer_config.json";
    std::ifstream in(config);
    if (!in) return;
    const Json j = Json::parse(in, nullptr, false);
    auto id_of = [&](const char* key) -> int64_t {
      if (!j.is_object() || !j.contains(key)) return -1;
      const Json& v = j[key];
      const std::string s = v.is_string() ? v.get<std::string>() : v.is_object() ? v.value("content", "") : "";
      const auto it = vocab_.find(s);
      return it == vocab_.end() ? -1 : it->second;
    };
    bos_id_ = id_of("bos_token");
    eos_id_ = id_of("eos_token");
  }

  // The leftmost (then longest) added token at or after `from`; its span,
  // widened over the whitespace lstrip/rstrip take, in [begin, end).
  const AddedToken* FindAdded(const std::string& text, size_t from, size_t* begin, size_t* end) const {
    const AddedToken* best = nullptr;
    size_t best_at = std::string::npos;
    for (const AddedToken& a : added_) {
      const size_t at = text.find(a.content, from);
      if (at == std::string::npos) continue;
      if (at < best_at || (at == best_at && a.content.size() > best->content.size())) best = &a, best_at = at;
    }
    if (best == nullptr) return nullptr;
    *begin = best_at, *end = best_at + best->content.size();
    auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
    while (best->lstrip && *begin > from && space(text[*begin - 1])) --*begin;
    while (best->rstrip && *end < text.size() && space(text[*end])) ++*end;
    return best;
  }

  std::string Normalize(std::string text) const {
    for (const icu::Normalizer2* n : normalizers_) {
      UErrorCode status = U_ZERO_ERROR;
      const icu::UnicodeString out = n->normalize(icu::UnicodeString::fromUTF8(text), status);
      ST_CHECK_ARG(U_SUCCESS(status), "normalizing a text for ", path_, " failed: ", u_errorName(status));
      text.clear();
      out.toUTF8String(text);
    }
    return text;
  }

  void EncodeOrdinary(const std::string& text, std::vector<int64_t>& ids) const {
    if (text.empty()) return;
    std::vector<std::string> pieces = {Normalize(text)};
    for (const PreTokenizerStep& step : pre_tokenizer_) {
      std::vector<std::string> next;
      for (std::string& piece : pieces) {
        if (step.add_prefix_space && (piece.empty() || piece[0] != ' ')) piece.insert(0, " ");
        std::vector<std::string> parts = step.split ? step.split->Split(piece) : std::vector<std::string>{piece};
        for (std::string& part : parts) next.push_back(step.byte_level ? ToByteChars(part) : std::move(part));
      }
      pieces = std::move(next);
    }
    for (const std::string& piece : pieces) Merge(piece, ids);
  }

  static std::string ToByteChars(const std::string& s) {
    std::string out;
    for (unsigned char c : s) out += Bytes().to_char[c];
    return out;
  }

  // The BPE merges of one piece (lowest rank first, leftmost among equals).
  void Merge(const std::string& piece, std::vector<int64_t>& ids) const {
    if (ignore_merges_) {
      const auto it = vocab_.find(piece);
      if (it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    {
      std::lock_guard<std::mutex> lock(cache_mu_);
      const auto hit = cache_.find(piece);
      if (hit != cache_.end()) {
        ids.insert(ids.end(), hit->second.begin(), hit->second.end());
        return;
      }
    }
    std::vector<std::string> symbols;
    for (size_t i = 0; i < piece.size();) {
      const size_t n = std::min(Utf8Length(piece[i]), piece.size() - i);
      symbols.push_back(piece.substr(i, n));
      i += n;
    }
    while (symbols.size() > 1) {
      int best_rank = INT_MAX;
      size_t best = 0;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        const auto it = merges_.find(symbols[i] + '\x01' + symbols[i + 1]);
        if (it != merges_.end() && it->second < best_rank) best_rank = it->second, best = i;
      }
      if (best_rank == INT_MAX) break;
      symbols[best] += symbols[best + 1];
      symbols.erase(symbols.begin() + best + 1);
    }
    std::vector<int64_t> out;
    for (const std::string& s : symbols) {
      const auto it = vocab_.find(s);
      if (it != vocab_.end()) {
        out.push_back(it->second);
      } else if (unk_id_ >= 0) {
        out.push_back(unk_id_);
      }
    }
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() < (1u << 20)) cache_.emplace(piece, out);
    ids.insert(ids.end(), out.begin(), out.end());
  }

  std::string path_;
  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int> merges_;  // "a\x01b" -> rank
  bool ignore_merges_ = false;
  int64_t unk_id_ = -1, bos_id_ = -1, eos_id_ = -1;
  std::vector<const icu::Normalizer2*> normalizers_;
  std::vector<PreTokenizerStep> pre_tokenizer_;
  std::vector<AddedToken> added_;
  std::unordered_set<int64_t> added_ids_;  // decoded as their content, not byte-mapped
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> LoadByteLevelBpe(const std::string& tokenizer_json) {
  return std::make_unique<ByteLevelBpe>(tokenizer_json);
}

}  // namespace shardtrain::examples::llama
