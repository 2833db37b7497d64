#include "comm/deadline_wait.h"

#include <algorithm>
#include <thread>

namespace shardtrain::comm {

bool WaitWithDeadline(const std::function<bool()>& poll, std::chrono::steady_clock::time_point deadline,
                      const std::function<void()>& on_timeout, std::chrono::microseconds max_sleep) {
  auto sleep = std::chrono::microseconds(1);
  while (true) {
    // Read the clock before polling: work that completes by the last poll counts as done.
    const bool expired = std::chrono::steady_clock::now() > deadline;
    if (poll()) return true;
    if (expired) {
      on_timeout();
      return false;
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::max(max_sleep, std::chrono::microseconds(1)));
  }
}

}  // namespace shardtrain::comm
