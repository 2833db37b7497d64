#include "base/names.h"

namespace shardtrain {

std::string JoinNames(const std::vector<std::string>& names, size_t max_shown, const std::string& quote) {
  if (names.empty()) return "(none)";
  std::string out;
  for (size_t i = 0; i < names.size() && i < max_shown; ++i) {
    const std::string q = names[i].empty() && quote.empty() ? "\"" : quote;
    out += (i ? ", " : "") + q + names[i] + q;
  }
  if (names.size() > max_shown) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

}  // namespace shardtrain
