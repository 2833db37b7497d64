// GlooCommunicator: collectives on CPU tensors over Gloo (LibTorch's c10d
// ProcessGroupGloo), for float32, float64, float16 and bfloat16 (and integers).
//
// Algorithms are chosen so every rank sends about (W-1)/W of the full buffer
// for all-gather and reduce-scatter: all-gather is Gloo's ring all-gather;
// reduce-scatter is an all-to-all of the W blocks followed by a local sum (in
// float32 for 16-bit inputs), never W all-reduces.
#ifndef SHARDTRAIN_COMM_GLOO_COMMUNICATOR_H_
#define SHARDTRAIN_COMM_GLOO_COMMUNICATOR_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace c10d {
class Backend;
}

namespace shardtrain::comm {

struct GlooOptions {
  std::string name = "world";
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Address or hostname this rank listens on; empty = $GLOO_SOCKET_IFNAME's
  // interface if set, else the machine's hostname (loopback as a fallback).
  std::string hostname;
  int threads = 2;  // Gloo worker threads (ops in flight at once)
  // Before each collective, ranks exchange (operation, element count, dtype,
  // root) and all throw InvalidArgumentError if they disagree. Without it a
  // mismatched call aborts the process inside Gloo's transport thread. Costs
  // one 32-byte all-gather per collective.
  bool verify_calls = true;
};

class GlooCommunicator : public Communicator {
 public:
  // Connects `size` ranks through `store`. Blocks until every rank joined or
  // the timeout passed (CommError then).
  static std::shared_ptr<GlooCommunicator> Create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                  GlooOptions options = {});
  ~GlooCommunicator() override;

  std::string backend() const override { return "gloo"; }
  WorkPtr AllGather(const at::Tensor& input, const at::Tensor& output) override;
  WorkPtr ReduceScatter(const at::Tensor& input, const at::Tensor& output, const ReduceOptions& options = {}) override;
  WorkPtr AllReduce(const at::Tensor& tensor, const ReduceOptions& options = {}) override;
  WorkPtr Broadcast(const at::Tensor& tensor, int root) override;
  WorkPtr Barrier() override;
  CommunicatorPtr NewGroup(const std::vector<int>& ranks, const std::string& name) override;

 private:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, GlooOptions options);
  void CheckCpu(const char* op, const at::Tensor& t) const;
  // Exchanges the call's signature with all ranks (see GlooOptions::verify_calls).
  void VerifySameCall(CommOp op, const at::Tensor& t, int64_t root);

  c10::intrusive_ptr<c10d::Store> store_;
  GlooOptions options_;
  c10::intrusive_ptr<c10d::Backend> pg_;
};

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_GLOO_COMMUNICATOR_H_
