#include "examples/common/flag_checks.h"

#include <cmath>

#include "base/numbers.h"

namespace shardtrain::examples {
namespace {

std::string IntRange(int64_t min, int64_t max) {
  if (max == kNoMaxInt) return "an integer >= " + std::to_string(min);
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

}  // namespace

void FailFlag(const std::string& flag, const std::string& value, const std::string& valid, const std::string& why) {
  throw FlagError("--" + flag + "=" + value + " is not valid" + (why.empty() ? "" : " (" + why + ")") +
                  "; valid: " + valid);
}

void CheckIntFlag(const std::string& flag, int64_t value, int64_t min, int64_t max) {
  if (value < min || value > max) FailFlag(flag, std::to_string(value), IntRange(min, max));
}

void CheckIntFlagOr(const std::string& flag, int64_t value, int64_t special, const std::string& special_meaning,
                    int64_t min, int64_t max) {
  if (value == special) return;
  if (value < min || value > max) {
    FailFlag(flag, std::to_string(value), std::to_string(special) + " (" + special_meaning + ") or " + IntRange(min, max));
  }
}

void CheckDoubleFlag(const std::string& flag, double value, double min, double max, bool min_open, bool max_open) {
  const bool below = min_open ? !(value > min) : !(value >= min);
  const bool above = max == kNoMax ? false : (max_open ? !(value < max) : !(value <= max));
  if (std::isfinite(value) && !below && !above) return;
  std::string valid = "a finite number ";
  if (max == kNoMax) {
    valid += (min_open ? "> " : ">= ") + ShortestDecimal(min);
  } else {
    valid += std::string("in ") + (min_open ? "(" : "[") + ShortestDecimal(min) + ", " + ShortestDecimal(max) +
             (max_open ? ")" : "]");
  }
  FailFlag(flag, ShortestDecimal(value), valid);
}

void CheckChoiceFlag(const std::string& flag, const std::string& value, const std::vector<std::string>& valid) {
  for (const auto& v : valid) {
    if (v == value) return;
  }
  std::string list;
  for (const auto& v : valid) list += (list.empty() ? "" : ", ") + v;
  FailFlag(flag, value, "one of " + list);
}

}  // namespace shardtrain::examples
