// The communication at the edges of tensor-parallel regions, as autograd
// functions (Megatron-LM's mappings; what DTensor's redistributes do between
// ColwiseParallel, RowwiseParallel and SequenceParallel layers). Each takes
// the tensor-parallel group; with nullptr (or a group of one) it is the
// identity. Every rank of the group runs the same ones in the same order, in
// forward and in backward. Split dimensions must divide by the group size.
#ifndef SHARDTRAIN_TENSOR_PARALLEL_COLLECTIVES_H_
#define SHARDTRAIN_TENSOR_PARALLEL_COLLECTIVES_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "comm/communicator.h"

namespace shardtrain::tensor_parallel {

// Identity forward; backward sums the gradient over the group (a replicated
// input entering column-parallel layers: each rank's gradient is partial).
at::Tensor CopyToRegion(const at::Tensor& x, const comm::CommunicatorPtr& group);
// Forward sums over the group (row-parallel partial outputs); backward identity.
at::Tensor ReduceFromRegion(const at::Tensor& x, const comm::CommunicatorPtr& group);
// Forward all-gathers along `dim` (rank r's block at r); backward keeps this
// rank's block of the (replicated) gradient.
at::Tensor GatherFromRegion(const at::Tensor& x, int64_t dim, const comm::CommunicatorPtr& group);
// Sequence parallel, entering a region: forward all-gathers along `dim` (the
// sequence); backward reduce-scatters the partial gradients along it.
at::Tensor GatherSequence(const at::Tensor& x, int64_t dim, const comm::CommunicatorPtr& group);
// Sequence parallel, leaving a region: forward reduce-scatters partial sums
// along `dim`; backward all-gathers the gradient.
at::Tensor ReduceScatterSequence(const at::Tensor& x, int64_t dim, const comm::CommunicatorPtr& group);
// This rank's block along `dim` (entering sequence parallelism from a
// replicated tensor); backward all-gathers the gradient.
at::Tensor SplitSequence(const at::Tensor& x, int64_t dim, const comm::CommunicatorPtr& group);

}  // namespace shardtrain::tensor_parallel

#endif  // SHARDTRAIN_TENSOR_PARALLEL_COLLECTIVES_H_
