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
