// Lists of names in messages, spelled one way everywhere: "a, b, c"; "(none)"
// for an empty list; past `max_shown` names, "a, b, ... (12 in all)". Errors
// that list what is valid, or what was wrong, use it. Plain C++.
#ifndef SHARDTRAIN_BASE_NAMES_H_
#define SHARDTRAIN_BASE_NAMES_H_

#include <cstddef>
#include <limits>
#include <string>
#include <vector>

namespace shardtrain {

// `names` joined by ", ", each between `quote`s ("'" gives 'a', 'b'); an empty
// name shows as its quotes ("" without a quote). At most `max_shown` names,
// then ", ... (N in all)".
std::string JoinNames(const std::vector<std::string>& names, size_t max_shown = std::numeric_limits<size_t>::max(),
                      const std::string& quote = "");

}  // namespace shardtrain

#endif  // SHARDTRAIN_BASE_NAMES_H_
