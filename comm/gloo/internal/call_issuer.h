// Internal to the Gloo backend (comm/gloo/); not part of the public API.
//
// Issuing collectives off the caller's thread (GlooOptions::verify_calls, or
// shared memory). The signature check is a round trip with every peer, which
// ends only when the slowest rank reaches the same call. Done on the caller's
// thread it would stall compute at every collective by the ranks' momentary
// skew (a prefetch could not run ahead of the peer). So each collective's
// check and start run, in call order, on one issuing thread per communicator;
// the caller gets a DeferredWork at once, whose Wait() first waits for the
// start (and rethrows a mismatch or a failed exchange), then for the
// collective itself. (GlooCommunicator::Submit and VerifySameCall are defined
// in call_issuer.cc.)
#ifndef SHARDTRAIN_COMM_GLOO_INTERNAL_CALL_ISSUER_H_
#define SHARDTRAIN_COMM_GLOO_INTERNAL_CALL_ISSUER_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/communicator.h"

namespace shardtrain::comm {
namespace gloo_internal {

// A collective handed to the issuing thread: done once started (its inner
// Work) or failed (the exception to rethrow from Wait()).
class DeferredWork : public Work {
 public:
  explicit DeferredWork(std::string what) : what_(std::move(what)) {}

  void Started(WorkPtr inner) { Finish(std::move(inner), nullptr); }
  void Failed(std::exception_ptr error) { Finish(nullptr, std::move(error)); }

  void Wait(std::chrono::milliseconds timeout) override;
  bool IsCompleted() override;

 private:
  void Finish(WorkPtr inner, std::exception_ptr error);

  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  WorkPtr inner_;
  std::exception_ptr error_;
};

}  // namespace gloo_internal

// One thread that starts a communicator's collectives in call order. After a
// failed exchange (the group's connections are then unusable) every later
// call fails with that error; a mismatched call (InvalidArgumentError) fails
// alone. Destruction fails the calls not started yet.
class GlooCallIssuer {
 public:
  struct Call {
    std::function<WorkPtr()> start;  // signature check, then the collective
    std::shared_ptr<gloo_internal::DeferredWork> work;
  };

  GlooCallIssuer() : thread_([this] { Loop(); }) {}
  ~GlooCallIssuer();

  void Push(Call call);

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Call> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_GLOO_INTERNAL_CALL_ISSUER_H_
