// The issuing thread and the call-signature check of GlooCommunicator (see
// internal/call_issuer.h).
#include "comm/gloo/internal/call_issuer.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstring>
#include <sstream>
#include <vector>

#include "base/errors.h"
#include "comm/gloo/internal/common.h"
#include "comm/gloo/internal/gloo_work.h"
#include "comm/gloo/shared_memory_mesh.h"
#include "comm/gloo_communicator.h"
#include "comm/wait_time.h"

namespace shardtrain::comm {
namespace gloo_internal {

void DeferredWork::Wait(std::chrono::milliseconds timeout) {
  WaitTimer blocked;  // for profilers (comm/wait_time.h); the inner Wait adds nothing more
  WorkPtr inner;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (timeout.count() > 0) {
      if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
        ST_THROW(CommTimeoutError, what_, " timed out after ", timeout.count(),
                 " ms on the issuing thread: the ranks' signature exchange or the shared memory transfer did not "
                 "complete (a peer rank may have died or not reached this collective)");
      }
    } else {
      // The signature exchange is bounded by the communicator's timeout and
      // then fails with a diagnosis of the peers; wait for that.
      cv_.wait(lock, [&] { return done_; });
    }
    if (error_) std::rethrow_exception(error_);
    inner = inner_;
  }
  inner->Wait(timeout);
}

bool DeferredWork::IsCompleted() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ && (error_ != nullptr || inner_->IsCompleted());
}

void DeferredWork::Finish(WorkPtr inner, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    inner_ = std::move(inner);
    error_ = std::move(error);
    done_ = true;
  }
  cv_.notify_all();
}

}  // namespace gloo_internal

using gloo_internal::SteadyClock;

GlooCallIssuer::~GlooCallIssuer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void GlooCallIssuer::Push(Call call) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(call));
  }
  cv_.notify_one();
}

void GlooCallIssuer::Loop() {
  at::NoGradGuard no_grad;
  std::exception_ptr broken;  // a failed exchange: the group's connections are unusable
  for (;;) {
    Call call;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      call = std::move(queue_.front());
      queue_.pop_front();
      if (stop_ && !broken) {
        broken =
            std::make_exception_ptr(CommError("the communicator was destroyed before this collective could start"));
      }
    }
    if (broken) {
      call.work->Failed(broken);
      continue;
    }
    try {
      call.work->Started(call.start());
    } catch (const InvalidArgumentError&) {
      call.work->Failed(std::current_exception());  // a mismatched call; the group stays usable
    } catch (...) {
      broken = std::current_exception();
      call.work->Failed(broken);
    }
  }
}

WorkPtr GlooCommunicator::Submit(CommOp op, const at::Tensor& t, int64_t root, IssuedCall call,
                                 std::function<WorkPtr()> start) {
  if (!issuer_) return start();  // verify_calls off, no shared memory: start here
  auto work = std::make_shared<gloo_internal::DeferredWork>(gloo_internal::Describe(gloo_internal::OpTitle(op), *group_));
  issuer_->Push({[this, op, t, root, call, start = std::move(start)] {
                   if (options_.verify_calls) VerifySameCall(op, t, root, call);
                   return start();
                 },
                 work});
  return work;
}

void GlooCommunicator::VerifySameCall(CommOp op, const at::Tensor& t, int64_t root, IssuedCall call) {
  // Cheap on purpose (it precedes every collective): the signature is written
  // through a raw pointer into buffers allocated once per communicator, and
  // exchanged through shared memory, or with an equal-split Gloo all-to-all
  // (every rank sends its signature to every rank), which measured about half
  // the latency of c10d's _allgather_base (that one gathers into a fresh flat
  // buffer and copies out).
  const int64_t mine[4] = {static_cast<int64_t>(op), t.defined() ? t.numel() : 0,
                           t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1, root};
  if (!signatures_.defined()) signatures_ = at::empty({4 * size_}, at::kLong);  // rank r's at [4r, 4r + 4)
  int64_t* all = signatures_.data_ptr<int64_t>();
  std::memcpy(all + 4 * rank_, mine, sizeof(mine));
  if (mesh_) {
    RunOnMesh(op, call, [&](SteadyClock::time_point deadline) {
      std::vector<SharedMemoryMesh::PeerTraffic> traffic(size_);
      std::vector<int64_t> starts(size_);
      for (int r = 0; r < size_; ++r) {
        traffic[r] = {{{mine, sizeof(mine)}}, sizeof(mine)};
        starts[r] = r * static_cast<int64_t>(sizeof(mine));
      }
      mesh_->Exchange(traffic, gloo_internal::CopyInto(reinterpret_cast<uint8_t*>(all), std::move(starts)), deadline);
    });
  } else {
    if (!signature_.defined()) signature_ = at::empty({4 * size_}, at::kLong);  // mine, once per destination rank
    int64_t* out = signature_.data_ptr<int64_t>();
    for (int r = 0; r < size_; ++r) std::memcpy(out + 4 * r, mine, sizeof(mine));
    try {
      std::vector<int64_t> equal_splits;
      gloo_internal::GlooWork(verify_pg_->alltoall_base(signatures_, signature_, equal_splits, equal_splits), group_,
                              op, call, timeout_, nullptr)
          .Wait(std::chrono::milliseconds(0));
    } catch (...) {
      // Gloo may still write into the buffers of a failed exchange: never reuse them.
      signature_.reset();
      signatures_.reset();
      throw;
    }
  }
  const int64_t* a = signatures_.data_ptr<int64_t>();
  bool same = true;
  for (int r = 1; r < size_ && same; ++r) same = std::memcmp(a + 4 * r, a, 4 * sizeof(int64_t)) == 0;
  if (same) return;
  std::ostringstream os;
  for (int r = 0; r < size_; ++r) {
    os << (r ? "; " : "") << "rank " << r << ": " << CommOpName(static_cast<CommOp>(a[4 * r])) << " of " << a[4 * r + 1]
       << " x " << (a[4 * r + 2] >= 0 ? c10::toString(static_cast<at::ScalarType>(a[4 * r + 2])) : "none");
    if (a[4 * r] == static_cast<int64_t>(CommOp::kBroadcast)) os << " from root " << a[4 * r + 3];
  }
  ST_THROW(InvalidArgumentError, "ranks of gloo group '", name_,
           "' issued different collectives (every rank must make the same call with the same size and dtype): ",
           os.str());
}

}  // namespace shardtrain::comm
