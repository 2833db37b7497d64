// Lexing of the Jinja subset: text and the tokens of tags, with jinja2's
// whitespace rules under trim_blocks and lstrip_blocks.
#include <algorithm>
#include <cctype>
#include <cstring>

#include "base/errors.h"
#include "examples/llama/jinja.h"

namespace shardtrain::examples::llama::jinja {
namespace {

const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "(",
                            ")",  "[",  "]",  "{",  "}",  ".",  ",", ":", "|", "<", ">", "="};

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& origin) : src_(src), origin_(origin) {}

  std::vector<Item> Run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t at = pos;
      while ((at = src_.find('{', at)) != std::string::npos && (at + 1 >= src_.size() || !strchr("{%#", src_[at + 1])))
        ++at;
      if (at == std::string::npos) at = src_.size();
      std::string text = src_.substr(pos, at - pos);
      const int text_line = line_;
      if (at < src_.size()) ApplyLeftStrip(text, src_[at + 1], at + 2 < src_.size() ? src_[at + 2] : 0, line_starting);
      CountLines(pos, at);
      if (!text.empty()) items_.push_back({Item::kText, text_line, text, {}});
      if (at == src_.size()) break;
      pos = ReadTag(at, line_starting);
    }
    return std::move(items_);
  }

 private:
  [[noreturn]] void Fail(int line, const std::string& what) const {
    ST_THROW(InvalidArgumentError, origin_, ": line ", line, ": ", what);
  }

  void CountLines(size_t from, size_t to) {
    for (size_t k = from; k < to; ++k) line_ += src_[k] == '\n';
  }

  // Whitespace before a tag: all of it before a `-`; under lstrip_blocks the
  // spaces and tabs that start its line before a block or comment tag.
  static void ApplyLeftStrip(std::string& text, char type, char sign, bool line_starting) {
    if (sign == '-') {
      size_t end = text.size();
      while (end > 0 && IsSpace(text[end - 1])) --end;
      text.resize(end);
    } else if (sign != '+' && type != '{') {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if (l_pos == 0 && !line_starting) return;
      if (text.find_first_not_of(" \t\r\f\v", l_pos) == std::string::npos) text.resize(l_pos);
    }
  }

  // Reads the tag at `at`; returns the position after it (and after the
  // whitespace its closing trims away).
  size_t ReadTag(size_t at, bool& line_starting) {
    const char type = src_[at + 1];
    size_t pos = at + 2;
    if (pos < src_.size() && (src_[pos] == '-' || src_[pos] == '+')) ++pos;
    const int line = line_;
    size_t close_end;
    if (type == '#') {
      const size_t close = src_.find("#}", pos);
      if (close == std::string::npos) Fail(line, "a comment {# is never closed with #}");
      close_end = close + 2;
      CountLines(at, close_end);
      return TrimAfter(close_end, src_[close - 1] == '-', true, line_starting);
    }
    Item item{type == '{' ? Item::kVar : Item::kBlock, line, "", {}};
    bool strip_after = false;
    close_end = Tokenize(pos, type == '{' ? '}' : '%', item.tokens, strip_after);
    if (item.kind == Item::kBlock && item.tokens.size() == 2 && item.tokens[0].kind == Token::kName &&
        item.tokens[0].text == "raw") {
      return ReadRaw(close_end, line, line_starting);
    }
    items_.push_back(std::move(item));
    return TrimAfter(close_end, strip_after, type == '%', line_starting);
  }

  // After a tag: all whitespace after a `-`, else one newline after a block
  // or comment (trim_blocks).
  size_t TrimAfter(size_t pos, bool strip, bool block, bool& line_starting) {
    const size_t from = pos;
    if (strip) {
      while (pos < src_.size() && IsSpace(src_[pos])) ++pos;
    } else if (block && pos < src_.size() && src_[pos] == '\n') {
      ++pos;
    }
    CountLines(from, pos);
    line_starting = pos > 0 && src_[pos - 1] == '\n';
    return pos;
  }

  size_t ReadRaw(size_t pos, int line, bool& line_starting) {
    for (size_t k = pos; (k = src_.find("{%", k)) != std::string::npos; ++k) {
      size_t j = k + 2;
      if (j < src_.size() && src_[j] == '-') ++j;
      while (j < src_.size() && IsSpace(src_[j])) ++j;
      if (src_.compare(j, 6, "endraw") != 0) continue;
      j += 6;
      while (j < src_.size() && IsSpace(src_[j])) ++j;
      const bool strip = j < src_.size() && src_[j] == '-';
      if (strip) ++j;
      if (src_.compare(j, 2, "%}") != 0) continue;
      items_.push_back({Item::kText, line, src_.substr(pos, k - pos), {}});
      CountLines(pos, j + 2);
      return TrimAfter(j + 2, strip, true, line_starting);
    }
    Fail(line, "{% raw %} is never closed with {% endraw %}");
  }

  // Tokens from `pos` to the tag's closing ("}}" or "%}", optionally "-"- or
  // "+"-prefixed) at bracket depth 0; returns the position after the closing.
  size_t Tokenize(size_t pos, char close, std::vector<Token>& out, bool& strip_after) {
    int depth = 0;
    const int start_line = line_;
    while (true) {
      while (pos < src_.size() && IsSpace(src_[pos])) line_ += src_[pos++] == '\n';
      if (pos >= src_.size()) Fail(start_line, std::string("a tag is never closed with ") + close + "}");
      if (depth == 0) {
        for (const char* sign : {"-", "+", ""}) {
          const std::string closing = std::string(sign) + close + "}";
          if (src_.compare(pos, closing.size(), closing) == 0) {
            strip_after = *sign == '-';
            out.push_back({Token::kEnd, "", 0, 0, line_});
            return pos + closing.size();
          }
        }
      }
      pos = ReadToken(pos, out);
      const std::string& t = out.back().text;
      if (out.back().kind == Token::kOp)
        depth += (t == "(" || t == "[" || t == "{") - (t == ")" || t == "]" || t == "}");
    }
  }

  size_t ReadToken(size_t pos, std::vector<Token>& out) {
    const char c = src_[pos];
    Token t;
    t.line = line_;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = pos;
      while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
      t.kind = Token::kName;
      t.text = src_.substr(pos, e - pos);
      out.push_back(t);
      return e;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) return ReadNumber(pos, t, out);
    if (c == '\'' || c == '"') return ReadString(pos, t, out);
    for (const char* op : kOps) {
      if (src_.compare(pos, strlen(op), op) == 0) {
        t.kind = Token::kOp;
        t.text = op;
        out.push_back(t);
        return pos + strlen(op);
      }
    }
    Fail(line_, std::string("unexpected character '") + c + "' in a tag");
  }

  size_t ReadNumber(size_t pos, Token& t, std::vector<Token>& out) {
    size_t e = pos;
    std::string digits;
    bool is_float = false;
    while (e < src_.size()) {
      const char d = src_[e];
      if (std::isdigit(static_cast<unsigned char>(d))) {
        digits += d;
      } else if (d == '.' && !is_float && e + 1 < src_.size() &&
                 std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
        is_float = true;
        digits += d;
      } else if ((d == 'e' || d == 'E') && e + 1 < src_.size() &&
                 (std::isdigit(static_cast<unsigned char>(src_[e + 1])) ||
                  ((src_[e + 1] == '-' || src_[e + 1] == '+') && e + 2 < src_.size() &&
                   std::isdigit(static_cast<unsigned char>(src_[e + 2]))))) {
        is_float = true;
        digits += d;
        digits += src_[++e];
      } else if (d != '_') {
        break;
      }
      ++e;
    }
    t.kind = is_float ? Token::kFloat : Token::kInt;
    t.text = digits;
    if (is_float) {
      t.f = std::strtod(digits.c_str(), nullptr);  // as Python, inf past the range of a double
    } else {
      try {
        t.i = std::stoll(digits);
      } catch (const std::out_of_range&) {
        Fail(line_, "integer literal " + digits + " is out of range");
      }
    }
    out.push_back(t);
    return e;
  }

  size_t ReadString(size_t pos, Token& t, std::vector<Token>& out) {
    const char quote = src_[pos];
    size_t e = pos + 1;
    t.kind = Token::kString;
    while (true) {
      if (e >= src_.size()) Fail(t.line, "a string literal is never closed");
      const char d = src_[e++];
      if (d == quote) break;
      if (d == '\n') ++line_;
      if (d != '\\' || e >= src_.size()) {
        t.text += d;
        continue;
      }
      const char x = src_[e++];
      const char plain = x == 'n'                               ? '\n'
                         : x == 't'                             ? '\t'
                         : x == 'r'                             ? '\r'
                         : x == '0'                             ? '\0'
                         : x == 'a'                             ? '\a'
                         : x == 'b'                             ? '\b'
                         : x == 'f'                             ? '\f'
                         : x == 'v'                             ? '\v'
                         : (x == '\\' || x == '\'' || x == '"') ? x
                                                                : 1;
      if (plain != 1) {
        t.text += plain;
      } else if (x == 'u' || x == 'x' || x == 'U') {
        const size_t n = x == 'x' ? 2 : x == 'u' ? 4 : 8;
        const std::string hex = src_.substr(e, n);
        if (hex.size() < n || !std::all_of(hex.begin(), hex.end(), [](char h) { return std::isxdigit(h & 0xff); }))
          Fail(t.line, "a truncated \\" + std::string(1, x) + " escape in a string literal (" + std::to_string(n) +
                           " hex digits expected)");
        const uint32_t code = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
        if (code > 0x10ffff || (code >= 0xd800 && code < 0xe000))
          Fail(t.line, "\\" + std::string(1, x) + hex + " in a string literal is not a Unicode scalar value");
        AppendUtf8(t.text, code);
        e += n;
      } else if (x == '\n') {
        ++line_;
      } else {
        t.text += '\\';
        t.text += x;
      }
    }
    out.push_back(t);
    return e;
  }

  const std::string& src_;
  const std::string& origin_;
  std::vector<Item> items_;
  int line_ = 1;
};

}  // namespace

std::vector<Item> Lex(const std::string& source, const std::string& origin) { return Lexer(source, origin).Run(); }

}  // namespace shardtrain::examples::llama::jinja
