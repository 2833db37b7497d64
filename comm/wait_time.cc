#include "comm/wait_time.h"

namespace shardtrain::comm {
namespace {
thread_local WaitTime* t_sink = nullptr;
thread_local int t_depth = 0;  // WaitTimers alive on this thread
}  // namespace

WaitTimeSink::WaitTimeSink(WaitTime* into) : previous_(t_sink) { t_sink = into; }
WaitTimeSink::~WaitTimeSink() { t_sink = previous_; }

WaitTimer::WaitTimer() : sink_(t_depth++ == 0 ? t_sink : nullptr) {
  if (sink_) start_ = std::chrono::steady_clock::now();
}

WaitTimer::~WaitTimer() {
  --t_depth;
  if (!sink_) return;
  sink_->nanoseconds +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
  ++sink_->calls;
}

}  // namespace shardtrain::comm
