// Internal to the Gloo backend (comm/gloo/); not part of the public API.
//
// GlooWork: the Work returned for a collective started on c10d's
// ProcessGroupGloo (defined in gloo_communicator.cc).
#ifndef SHARDTRAIN_COMM_GLOO_INTERNAL_GLOO_WORK_H_
#define SHARDTRAIN_COMM_GLOO_INTERNAL_GLOO_WORK_H_

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/gloo/internal/common.h"

namespace shardtrain::comm::gloo_internal {

// Wraps a c10d Work: turns engine errors into CommError naming the operation,
// the group and (from heartbeats) the peer at fault, and runs a local
// completion step (unpacking, local sums, scaling) exactly once after the
// collective finished.
class GlooWork : public Work {
 public:
  GlooWork(c10::intrusive_ptr<c10d::Work> work, std::shared_ptr<const GlooGroupRef> group, CommOp op, IssuedCall call,
           std::chrono::milliseconds timeout, std::function<void()> finish)
      : work_(std::move(work)),
        group_(std::move(group)),
        op_(op),
        call_(call),
        timeout_(timeout),
        finish_(std::move(finish)) {}

  void Wait(std::chrono::milliseconds timeout) override;
  bool IsCompleted() override { return done_ || work_->isCompleted(); }

 private:
  std::mutex mu_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::shared_ptr<const GlooGroupRef> group_;
  CommOp op_;
  IssuedCall call_;
  std::chrono::milliseconds timeout_;
  std::function<void()> finish_;
  std::atomic<bool> done_{false};
  bool timed_out_ = false;
  std::string error_;
};

}  // namespace shardtrain::comm::gloo_internal

#endif  // SHARDTRAIN_COMM_GLOO_INTERNAL_GLOO_WORK_H_
