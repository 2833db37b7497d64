#include "tests/testing/proc_status.h"

#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace shardtrain::testing {

int64_t ProcStatusKb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size()));
  }
  return -1;
}

bool ResetPeakRss() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

}  // namespace shardtrain::testing
