// Metric values as checkpoint text, and the messages the callbacks share (private to the callbacks).
#ifndef SHARDTRAIN_TRAINER_CALLBACKS_INTERNAL_METRIC_TEXT_H_
#define SHARDTRAIN_TRAINER_CALLBACKS_INTERNAL_METRIC_TEXT_H_

#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "base/errors.h"
#include "base/names.h"

namespace shardtrain::trainer::internal {

inline std::string Num(double v) {
  std::ostringstream os;
  os << std::setprecision(17) << v;
  return os.str();
}

inline double ParseNum(const std::string& s) {
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (s == "inf") return std::numeric_limits<double>::infinity();
  if (s == "-inf") return -std::numeric_limits<double>::infinity();
  return std::stod(s);
}

// Python's repr of a str ('val_loss'), or None for "" when `none_if_empty`:
// the values of Lightning's callback state keys (Callback::state_key).
inline std::string PyRepr(const std::string& s, bool none_if_empty = false) {
  if (s.empty() && none_if_empty) return "None";
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') out += '\\';
    out += c;
  }
  return out + q;
}

inline std::string Available(const std::map<std::string, double>& metrics) {
  std::vector<std::string> names;
  for (const auto& [k, v] : metrics) names.push_back(k);
  return JoinNames(names);
}

inline void CheckMode(const char* who, const std::string& mode) {
  ST_CHECK_ARG(mode == "min" || mode == "max", who, ": unknown mode '", mode, "'; valid: min, max");
}

}  // namespace shardtrain::trainer::internal

#endif  // SHARDTRAIN_TRAINER_CALLBACKS_INTERNAL_METRIC_TEXT_H_
