#include "base/numbers.h"

#include <charconv>
#include <cmath>

namespace shardtrain {

std::string ShortestDecimal(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), value);  // shortest round-trip form
  return std::string(buf, res.ptr);
}

}  // namespace shardtrain
