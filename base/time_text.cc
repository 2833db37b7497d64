#include "base/time_text.h"

#include <chrono>
#include <sstream>

namespace shardtrain {

int64_t WallClockMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string FormatSeconds(int64_t ms) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << ms / 1000.0 << " s";
  return os.str();
}

}  // namespace shardtrain
