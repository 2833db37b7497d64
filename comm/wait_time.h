// Time blocked in Work::Wait, for profilers (trainer/profilers/profiler.h).
//
// A profiler installs a WaitTimeSink on the thread that drives training; from
// then on every Work::Wait() on that thread (Gloo, NCCL) adds the time it was
// blocked and one call to the sink, until the sink is destroyed. Waits on
// other threads (a backend's issuing thread) are not counted. Without a sink
// a Wait() costs one thread-local read more. Plain C++ (no torch header).
#ifndef SHARDTRAIN_COMM_WAIT_TIME_H_
#define SHARDTRAIN_COMM_WAIT_TIME_H_

#include <chrono>
#include <cstdint>

namespace shardtrain::comm {

// What a sink has accumulated.
struct WaitTime {
  int64_t calls = 0;     // Wait() calls (nested waits of one collective count once)
  int64_t nanoseconds = 0;
};

// Installs `into` on the calling thread for its lifetime (restoring the sink
// installed before, if any). Create and destroy it on the same thread.
class WaitTimeSink {
 public:
  explicit WaitTimeSink(WaitTime* into);
  ~WaitTimeSink();
  WaitTimeSink(const WaitTimeSink&) = delete;
  WaitTimeSink& operator=(const WaitTimeSink&) = delete;

 private:
  WaitTime* previous_;
};

// Held by a backend's Work::Wait() for the time it blocks: adds that time to
// the calling thread's sink (a no-op without one; a timer inside another on
// the same thread adds nothing, so a wrapper's Wait and its inner Wait count once).
class WaitTimer {
 public:
  WaitTimer();
  ~WaitTimer();
  WaitTimer(const WaitTimer&) = delete;
  WaitTimer& operator=(const WaitTimer&) = delete;

 private:
  WaitTime* sink_;  // null: nothing to do
  std::chrono::steady_clock::time_point start_;
};

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_WAIT_TIME_H_
