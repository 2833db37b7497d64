// OptionTable's non-template parts and the typed option parsers
// (strategies/option_table.h).
#include "base/names.h"
#include "strategies/option_table.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "base/errors.h"

namespace shardtrain::strategies {
namespace {

std::string Lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

void ThrowUnknownOption(const std::string& strategy, const std::string& key, std::vector<std::string> valid) {
  std::sort(valid.begin(), valid.end());
  ST_THROW(InvalidArgumentError, "strategy '", strategy, "': unknown option ", key, "; valid options: ", JoinNames(valid));
}

std::vector<std::string> OptionKeys(const std::vector<OptionDoc>& docs) {
  std::vector<std::string> keys;
  for (const auto& d : docs) keys.push_back(d.key);
  std::sort(keys.begin(), keys.end());
  return keys;
}

std::string MarkdownCell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';  // a bare '|' would end the cell
    out += c == '\n' ? ' ' : c;
  }
  return out;
}

std::string OptionDocsMarkdown(const std::vector<OptionDoc>& docs) {
  std::string out = "| option | values | what it does |\n| --- | --- | --- |\n";
  for (const auto& d : docs) {
    out += "| `" + MarkdownCell(d.key) + "` | " + MarkdownCell(d.values) + " | " + MarkdownCell(d.doc) + " |\n";
  }
  return out;
}

namespace option_parsing {

bool ParseBool(const std::string& strategy, const std::string& key, const std::string& value) {
  std::string v = Lower(value);
  if (v == "true" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "no") return false;
  ST_THROW(InvalidArgumentError, "strategy '", strategy, "': option ", key, "='", value,
           "' is not a boolean; valid: true, false, 1, 0, yes, no");
}

int64_t ParseInt(const std::string& strategy, const std::string& key, const std::string& value) {
  // Accept "1e8" (fairscale's default is written that way) when it is integral.
  double d = ParseDouble(strategy, key, value);
  ST_CHECK_ARG(std::floor(d) == d && std::abs(d) < 9e18, "strategy '", strategy, "': option ", key, "='", value,
               "' is not an integer");
  return static_cast<int64_t>(d);
}

double ParseDouble(const std::string& strategy, const std::string& key, const std::string& value) {
  size_t pos = 0;
  double d = 0;
  try {
    d = std::stod(value, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  ST_CHECK_ARG(pos == value.size() && !value.empty() && std::isfinite(d), "strategy '", strategy, "': option ", key,
               "='", value, "' is not a number");
  return d;
}

c10::ScalarType ParseDtype(const std::string& strategy, const std::string& key, const std::string& value) {
  std::string v = Lower(value);
  if (v == "bf16" || v == "bfloat16") return c10::ScalarType::BFloat16;
  if (v == "fp16" || v == "float16" || v == "half") return c10::ScalarType::Half;
  if (v == "fp32" || v == "float32" || v == "float") return c10::ScalarType::Float;
  ST_THROW(InvalidArgumentError, "strategy '", strategy, "': option ", key, "='", value,
           "' is not a supported dtype; valid: bf16, fp16, fp32");
}

std::string DtypeName(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16:
      return "bf16";
    case c10::ScalarType::Half:
      return "fp16";
    case c10::ScalarType::Float:
      return "fp32";
    default:
      return c10::toString(t);
  }
}

}  // namespace option_parsing
}  // namespace shardtrain::strategies
