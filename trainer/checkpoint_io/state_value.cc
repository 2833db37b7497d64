#include "trainer/checkpoint_io/state_value.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "base/errors.h"

namespace shardtrain::trainer {
namespace {

std::string Exact(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  // The shortest form that reads back the same (1e-05, not 1.0000000000000001e-05).
  for (int p = 1; p < 17; ++p) {
    char s[40];
    std::snprintf(s, sizeof(s), "%.*g", p, v);
    if (std::strtod(s, nullptr) == v) {
      std::string out = s;
      // A float must not read back as an int: "2" -> "2.0".
      if (out.find_first_of(".eEn") == std::string::npos) out += ".0";
      return out;
    }
  }
  std::string out = buf;
  if (out.find_first_of(".eEn") == std::string::npos) out += ".0";
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
