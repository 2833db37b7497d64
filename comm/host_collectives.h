// Collectives on host (CPU) tensors over any backend, written once for the
// trainer's and the strategies' small scalar traffic (losses, metrics, flags,
// lengths). NCCL takes only CUDA tensors, so with it the data makes a round
// trip through the current CUDA device ("host staging"); Gloo takes the
// tensor as it is. Every function blocks until the collective finished and
// leaves the result in the caller's tensor.
#ifndef SHARDTRAIN_COMM_HOST_COLLECTIVES_H_
#define SHARDTRAIN_COMM_HOST_COLLECTIVES_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "comm/communicator.h"

namespace shardtrain::comm {

// Where the communicator's tensors must live: the current CUDA device for
// NCCL, the CPU otherwise. Allocate there to avoid staging.
c10::Device CollectiveDevice(const Communicator& c);

// All-reduce of `tensor` in place (nothing at world size 1).
void HostAllReduce(Communicator& c, const at::Tensor& tensor, ReduceOp op);

// All-gather of `input` into `output` (world size x input).
void HostAllGather(Communicator& c, const at::Tensor& input, const at::Tensor& output);

// Broadcast of `tensor` from `root`, in place.
void HostBroadcast(Communicator& c, const at::Tensor& tensor, int root);

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_HOST_COLLECTIVES_H_
