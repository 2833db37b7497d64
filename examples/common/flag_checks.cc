#include "examples/common/flag_checks.h"

#include <charconv>
#include <cmath>

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
    valid += (min_open ? "> " : ">= ") + FormatNumber(min);
  } else {
    valid += std::string("in ") + (min_open ? "(" : "[") + FormatNumber(min) + ", " + FormatNumber(max) +
             (max_open ? ")" : "]");
  }
  FailFlag(flag, FormatNumber(value), valid);
}

void CheckChoiceFlag(const std::string& flag, const std::string& value, const std::vector<std::string>& valid) {
  for (const auto& v : valid) {
    if (v == value) return;
  }
  std::string list;
  for (const auto& v : valid) list += (list.empty() ? "" : ", ") + v;
  FailFlag(flag, value, "one of " + list);
}

std::string FormatNumber(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, res.ptr);
}

}  // namespace shardtrain::examples
