#include "trainer/checkpoint_io/state_value.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "base/errors.h"
#include "base/numbers.h"

namespace shardtrain::trainer {
namespace {

// ShortestDecimal's text, which a float keeps when read back: "2" -> "2.0".
std::string Exact(double v) {
  std::string out = ShortestDecimal(v);
  if (out.find_first_of(".eEn") == std::string::npos) out += ".0";  // not nan, inf, 1e+20
  return out;
}

}  // namespace

StateValue StateValue::Infer(const std::string& s) {
  if (s == "true" || s == "True") return StateValue(true);
  if (s == "false" || s == "False") return StateValue(false);
  if (s == "None") return StateValue();
  if (s.empty()) return StateValue(s);
  errno = 0;
  char* end = nullptr;
  const long long i = std::strtoll(s.c_str(), &end, 10);
  if (errno == 0 && end && *end == '\0') return StateValue(static_cast<int64_t>(i));
  if (s == "nan") return StateValue(std::nan(""));
  if (s == "inf") return StateValue(HUGE_VAL);
  if (s == "-inf") return StateValue(-HUGE_VAL);
  const char c = s[0];
  const bool numeric_start = (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.';
  end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (numeric_start && end && *end == '\0') return StateValue(d);
  return StateValue(s);
}

double StateValue::AsDouble() const {
  if (is<bool>()) return get<bool>() ? 1 : 0;
  if (is<int64_t>()) return static_cast<double>(get<int64_t>());
  if (is<double>()) return get<double>();
  if (is<ScoreTensor>()) return get<ScoreTensor>().value;
  ST_THROW(InvalidArgumentError, "expected a number, got a ", TypeName(), " (", ToString(), ")");
}

std::string StateValue::ToString() const {
  struct Visitor {
    std::string operator()(std::monostate) const { return "None"; }
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return Exact(d); }
    std::string operator()(const std::string& s) const { return s; }
    std::string operator()(const std::vector<double>& v) const {
      std::string out;
      for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + Exact(v[i]);
      return out;
    }
    std::string operator()(ScoreTensor t) const { return Exact(t.value); }
    std::string operator()(const Scores& m) const {
      std::string out;
      for (const auto& [k, v] : m) out += k + "\t" + Exact(v.value) + "\n";
      return out;
    }
  };
  return std::visit(Visitor{}, v_);
}

std::string StateValue::TypeName() const {
  static const char* const kNames[] = {"NoneType", "bool", "int", "float", "str", "list", "Tensor", "dict"};
  return kNames[v_.index()];
}

std::map<std::string, std::string> ToStrings(const StateDict& d) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : d) out[k] = v.ToString();
  return out;
}

StateDict InferTypes(const std::map<std::string, std::string>& d) {
  StateDict out;
  for (const auto& [k, v] : d) out[k] = StateValue::Infer(v);
  return out;
}

}  // namespace shardtrain::trainer
